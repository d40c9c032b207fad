"""What this machine is: the CPU, memory, GPUs with their free memory, and the versions that
matter. The server's `/hardware` route answers with it; `met bench certify` picks a box class
by it."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def describe() -> dict[str, Any]:
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            devices.append(
                {
                    "index": i,
                    "name": props.name,
                    "memory_total_bytes": total,
                    "memory_free_bytes": free,
                    "capability": f"{props.major}.{props.minor}",
                }
            )
    try:
        page_size, num_pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
        memory_bytes = page_size * num_pages
    except (ValueError, OSError, AttributeError):
        memory_bytes = None
    return {
        "cpu": {
            "model": cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "memory_total_bytes": memory_bytes,
        "gpus": devices,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "platform": platform.platform(),
        },
    }


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...); empty where
    there is no such file."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {
        k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())
    }


def cpu_model() -> str:
    return cpuinfo().get("model name") or platform.processor() or platform.machine()
