"""What `met doctor` looks at, outside the model: the platform, the port and the hub cache.

Every gatherer here reads local state only (no network, nothing downloaded) and never raises:
a fact it cannot read is None, and the check built on it says so. The model's own checks
(`ModelInspector`), the report and the command line are in `doctor.py`.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import os
import platform
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

MEMINFO_PATH = Path("/proc/meminfo")
NVIDIA_DRIVER_PATH = Path("/proc/driver/nvidia/version")
# The flags that decide which CPU kernels run fast: AVX2 for any vectorised product, AVX-512
# and its bf16 and VNNI extensions for oneDNN's bf16 and int8 paths, AMX for Sapphire Rapids'
# matrix tiles.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
LOW_DISK_BYTES = 10 * 2**30  # below this, downloading a checkpoint of a few billion weights fails


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"  # a blocker: `met serve` would not start, or not serve this
    SKIP = "skip"  # a check an earlier failure left nothing to look at


@dataclass(frozen=True)
class Check:
    """One line of the report; `fix` says what to do when the status is warn or fail."""

    name: str
    status: Status
    detail: str
    fix: str | None = None


def gib(num_bytes: float) -> str:
    """Bytes as GiB, with enough digits that a small model does not read 0.0 (MiB below
    0.1 GiB)."""
    value = num_bytes / 2**30
    if abs(value) < 0.1:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{value:.1f} GiB" if abs(value) >= 10 else f"{value:.2f} GiB"


def safely(read: Callable[[], T], default: T) -> T:
    """`read()`, or `default` when it raises: a fact we cannot read is no reason to stop."""
    try:
        return read()
    except Exception:
        return default


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    free_bytes: int
    total_bytes: int
    capability: str  # e.g. "9.0"


@dataclass(frozen=True)
class Cpu:
    model_name: str | None
    num_logical_cores: int | None
    num_usable_cores: int | None  # this process's affinity (taskset, cgroups)
    flags: tuple[str, ...]  # of CPU_FLAGS, those the CPU has
    torch_capability: str | None  # torch.backends.cpu.get_cpu_capability(): the kernels it picks
    mem_available_bytes: int | None  # /proc/meminfo MemAvailable
    mem_total_bytes: int | None


@dataclass(frozen=True)
class Platform:
    """The software and hardware `met serve` would run on."""

    python: str
    python_executable: str
    torch: str | None
    torch_cuda: str | None  # the CUDA runtime torch was built with; None for a CPU build
    triton: str | None
    cuda_driver: str | None  # the kernel module's version
    cuda_driver_api: str | None  # the CUDA version the driver supports
    gpus: tuple[Gpu, ...]
    gpu_error: str | None  # why no GPU could be listed, if asking failed
    cpu: Cpu


def gather_platform() -> Platform:
    import torch

    gpus, gpu_error = _gpus()
    return Platform(
        python=platform.python_version(),
        python_executable=sys.executable,
        torch=safely(lambda: str(torch.__version__), None),
        torch_cuda=safely(lambda: torch.version.cuda, None),
        triton=safely(lambda: importlib.metadata.version("triton"), None),
        cuda_driver=safely(_nvidia_driver_version, None),
        cuda_driver_api=safely(_cuda_driver_api, None),
        gpus=gpus,
        gpu_error=gpu_error,
        cpu=_cpu(),
    )


def _gpus() -> tuple[tuple[Gpu, ...], str | None]:
    import torch

    try:
        if not torch.cuda.is_available():
            return (), None
        gpus = []
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            major, minor = torch.cuda.get_device_capability(index)
            gpus.append(
                Gpu(index, torch.cuda.get_device_name(index), free, total, f"{major}.{minor}")
            )
        return tuple(gpus), None
    except Exception as e:  # a driver in a bad state raises from any of these
        return (), f"{type(e).__name__}: {e}"


def _nvidia_driver_version() -> str | None:
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 ..."
    words = NVIDIA_DRIVER_PATH.read_text().split()
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


def _cuda_driver_api() -> str | None:
    """The CUDA version the driver supports, from libcuda itself (cuDriverGetVersion)."""
    import ctypes

    version = ctypes.c_int()
    if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"  # 13000 -> "13.0"


def _cpu() -> Cpu:
    import torch

    from metrale.hardware import cpuinfo

    fields = cpuinfo()
    flags = set(fields.get("flags", "").split())
    meminfo = safely(lambda: meminfo_bytes(MEMINFO_PATH.read_text()), {})
    return Cpu(
        model_name=fields.get("model name"),
        num_logical_cores=os.cpu_count(),
        num_usable_cores=safely(lambda: len(os.sched_getaffinity(0)), None),
        flags=tuple(f for f in CPU_FLAGS if f in flags),
        torch_capability=safely(lambda: str(torch.backends.cpu.get_cpu_capability()), None),
        mem_available_bytes=meminfo.get("MemAvailable"),
        mem_total_bytes=meminfo.get("MemTotal"),
    )


def meminfo_bytes(text: str) -> dict[str, int]:
    """/proc/meminfo's "MemAvailable:  1234 kB" lines as {"MemAvailable": bytes}."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if parts[1:] == ["kB"] else 1
            values[key.strip()] = int(parts[0]) * scale
    return values


def platform_checks(p: Platform) -> list[Check]:
    return [
        Check("python", Status.OK, f"{p.python} ({p.python_executable})"),
        _torch_check(p),
        _triton_check(p),
        _cuda_check(p),
        _gpus_check(p),
        _cpu_check(p.cpu),
    ]


def _torch_check(p: Platform) -> Check:
    if p.torch is None:
        return Check("torch", Status.FAIL, "torch cannot be imported", "pip install torch")
    build = f"CUDA {p.torch_cuda} build" if p.torch_cuda else "CPU build"
    return Check("torch", Status.OK, f"{p.torch} ({build})")


def _triton_check(p: Platform) -> Check:
    if p.triton is not None:
        return Check("triton", Status.OK, p.triton)
    if p.gpus:
        return Check(
            "triton",
            Status.FAIL,
            "not installed, and on a GPU the engine's attention and fused kernels are Triton's",
            "pip install triton, or pass --attention-backend torch",
        )
    return Check("triton", Status.OK, "not installed (only the GPU kernels need it)")


def _cuda_check(p: Platform) -> Check:
    driver = ", ".join(
        part
        for part in (
            p.cuda_driver and f"driver {p.cuda_driver}",
            p.cuda_driver_api and f"driver supports CUDA {p.cuda_driver_api}",
        )
        if part
    )
    if p.torch_cuda is None:
        detail = "torch is a CPU build: no CUDA runtime"
        return Check("cuda", Status.OK, f"{detail}; {driver}" if driver else detail)
    if not p.gpus:
        why = p.gpu_error or "torch.cuda.is_available() is false"
        return Check(
            "cuda",
            Status.WARN,
            f"torch is built for CUDA {p.torch_cuda} but sees no GPU ({why}); "
            f"{driver or 'no NVIDIA driver found'}",
            "check the driver with nvidia-smi and that CUDA_VISIBLE_DEVICES names a GPU; "
            "a driver older than the runtime needs updating",
        )
    return Check("cuda", Status.OK, f"runtime {p.torch_cuda}; {driver or 'driver unknown'}")


def _gpus_check(p: Platform) -> Check:
    if not p.gpus:
        return Check("gpus", Status.OK, "none visible: the engine runs on the CPU")
    listed = "; ".join(
        f"{g.index}: {g.name} (sm {g.capability}), {gib(g.free_bytes)} free of {gib(g.total_bytes)}"
        for g in p.gpus
    )
    return Check("gpus", Status.OK, listed)


def _cpu_check(cpu: Cpu) -> Check:
    cores = f"{cpu.num_usable_cores} cores usable of {cpu.num_logical_cores}"
    flags = " ".join(cpu.flags) or "none of " + " ".join(CPU_FLAGS)
    ram = f"{gib(cpu.mem_available_bytes)} RAM available" if cpu.mem_available_bytes else ""
    detail = ", ".join(
        part
        for part in (
            cpu.model_name or "model unknown",
            cores,
            flags,
            f"torch kernels {cpu.torch_capability}",
            ram,
        )
        if part
    )
    if "avx2" not in cpu.flags:
        return Check(
            "cpu",
            Status.WARN,
            detail,
            "this CPU has no AVX2: CPU inference runs slowly; serve on a GPU or a newer CPU",
        )
    return Check("cpu", Status.OK, detail)


def port_check(bind: str, port: int) -> Check:
    """Whether `met serve --bind BIND --port PORT` could listen, tried as uvicorn binds."""
    name = "port"
    where = f"{bind}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (OSError, UnicodeError) as e:
        return Check(name, Status.FAIL, f"--bind {bind!r} is no address: {e}", "fix --bind")
    with contextlib.closing(socket.socket(family, kind, proto)) as sock:
        # uvicorn sets SO_REUSEADDR, so a port in TIME_WAIT is free to it, and to us
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            return Check(name, Status.FAIL, f"cannot listen on {where}: {e}", _port_fix(e, port))
    return Check(name, Status.OK, f"{where} is free")


def _port_fix(e: OSError, port: int) -> str:
    if e.errno == errno.EADDRINUSE:
        return (
            f"port {port} is in use: pass --port N, or stop what holds it "
            f"(`ss -ltnp 'sport = :{port}'` names it)"
        )
    if e.errno == errno.EACCES:
        return f"port {port} needs privileges: pass --port 1024 or above"
    if e.errno == errno.EADDRNOTAVAIL:
        return "--bind names no address of this machine: use 127.0.0.1 or 0.0.0.0"
    return "pass another --port or --bind"


@dataclass(frozen=True)
class HubCache:
    path: str  # where `met serve` looks for Hugging Face ids (HF_HUB_CACHE rules)
    huggingface_hub_path: str | None  # huggingface_hub.constants.HF_HUB_CACHE, downloads' home
    exists: bool
    writable: bool
    disk_free_bytes: int | None


def hub_cache_check() -> tuple[Check, HubCache]:
    from metrale.checkpoint.resolve import hub_cache_dir

    path = hub_cache_dir()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    free = safely(lambda: shutil.disk_usage(existing).free, None) if existing else None
    facts = HubCache(
        path=str(path),
        huggingface_hub_path=safely(_huggingface_hub_cache, None),
        exists=path.is_dir(),
        writable=existing is not None and os.access(existing, os.W_OK),
        disk_free_bytes=free,
    )
    shown = f"{path}{'' if facts.exists else ' (not made yet)'}"
    if free is None:
        return Check("hf cache", Status.WARN, f"{shown}: free disk unknown"), facts
    detail = f"{shown}, {gib(free)} free"
    if not facts.writable:
        fix = "downloads would fail: set HF_HUB_CACHE (or HF_HOME) to a writable directory"
        return Check("hf cache", Status.WARN, f"{detail}, not writable", fix), facts
    if free < LOW_DISK_BYTES:
        fix = f"free disk or set HF_HUB_CACHE to a larger disk: {gib(free)} holds few checkpoints"
        return Check("hf cache", Status.WARN, detail, fix), facts
    return Check("hf cache", Status.OK, detail), facts


def _huggingface_hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


@dataclass(frozen=True)
class MemoryFit:
    """Whether the weights and the KV cache of one `max_seq_len`-long request fit in
    `budget_bytes`, by the arithmetic the engine sizes its pool with: whole blocks of
    `CacheConfig.bytes_per_block` (2 x layers x block_size x kv_heads x head_dim x dtype bytes).
    """

    device: str
    budget_bytes: int  # what the weights and the KV cache may take together
    budget: str  # how the budget was reckoned, for the report
    weight_bytes: int
    bytes_per_block: int
    block_size: int
    max_seq_len: int
    max_position_embeddings: int

    def kv_bytes_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) * self.bytes_per_block

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_for(self.max_seq_len)

    @property
    def fits(self) -> bool:
        return self.weight_bytes + self.kv_bytes <= self.budget_bytes

    @property
    def largest_max_seq_len(self) -> int:
        """The longest max_seq_len that fits, at most the model's max_position_embeddings; 0
        when the weights leave no room for one block."""
        num_blocks = max(0, (self.budget_bytes - self.weight_bytes) // self.bytes_per_block)
        return min(num_blocks * self.block_size, self.max_position_embeddings)

    def as_facts(self) -> dict[str, object]:
        return {
            **{k: v for k, v in vars(self).items()},
            "kv_bytes": self.kv_bytes,
            "fits": self.fits,
            "largest_max_seq_len": self.largest_max_seq_len,
        }


def memory_budget(
    device: torch.device, gpu_memory_utilization: float, p: Platform
) -> tuple[int, str] | None:
    """What the weights and the KV pool may take together, as the engine reckons it, and how:
    on a GPU `gpu_memory_utilization` of its memory less what is in use already (as
    `runner.gpu_memory.kv_blocks_for_gpu`, before the activation peak it measures at start);
    on a CPU the host's available memory. None when it cannot be read."""
    if device.type != "cuda":
        available = p.cpu.mem_available_bytes
        return None if available is None else (available, "MemAvailable RAM")
    index = device.index or 0
    gpu = next((g for g in p.gpus if g.index == index), None)
    if gpu is None:
        return None
    in_use = gpu.total_bytes - gpu.free_bytes
    return (
        int(gpu.total_bytes * gpu_memory_utilization) - in_use,
        f"{gpu_memory_utilization:.2f} x {gib(gpu.total_bytes)} of GPU {index} less "
        f"{gib(in_use)} in use, before the activation peak",
    )


def memory_check(fit: MemoryFit) -> Check:
    summary = (
        f"weights {gib(fit.weight_bytes)} + KV {gib(fit.kv_bytes)} for --max-seq-len "
        f"{fit.max_seq_len:,}"
    )
    if fit.fits:
        capped = (
            " (the model's max_position_embeddings)"
            if fit.largest_max_seq_len == fit.max_position_embeddings
            else ""
        )
        return Check(
            "memory",
            Status.OK,
            f"{summary} fit in {gib(fit.budget_bytes)} ({fit.budget}); max_seq_len up to "
            f"{fit.largest_max_seq_len:,} fits{capped}",
        )
    on_gpu = fit.device.startswith("cuda")
    if fit.largest_max_seq_len == 0:
        fix = (
            "use a GPU with more free memory, raise --gpu-memory-utilization, or --dtype bfloat16"
            if on_gpu
            else "free RAM, pass --dtype bfloat16, or serve a smaller model"
        )
        detail = f"the weights ({gib(fit.weight_bytes)}) leave no room for KV blocks"
        return Check("memory", Status.FAIL, f"{detail} in {gib(fit.budget_bytes)}", fix)
    fix = f"use --max-seq-len {fit.largest_max_seq_len} or less"
    if on_gpu:
        fix += ", --kv-cache-dtype fp8, or raise --gpu-memory-utilization"
    detail = f"{summary} exceed {gib(fit.budget_bytes)} ({fit.budget})"
    return Check("memory", Status.FAIL, detail, fix)


def kv_pool_check(fit: MemoryFit, num_blocks: int | None, flag: str) -> Check:
    """The KV pool against the memory and max_seq_len: on a CPU (or with --num-kv-blocks) its
    size is fixed by `flag`; on a GPU the engine sizes it at start."""
    if num_blocks is None:
        estimate = max(0, (fit.budget_bytes - fit.weight_bytes) // fit.bytes_per_block)
        detail = (
            f"sized by the engine at start: about {estimate:,} blocks of {fit.block_size} "
            f"tokens ({estimate * fit.block_size:,} tokens), less the activation peak"
        )
        if estimate < 1:  # the engine stops at start (`kv_blocks_for_gpu`)
            fix = "raise --gpu-memory-utilization, or free the GPU's memory"
            return Check("kv pool", Status.FAIL, detail, fix)
        return Check("kv pool", Status.OK, detail)
    pool_bytes, pool_tokens = num_blocks * fit.bytes_per_block, num_blocks * fit.block_size
    detail = (
        f"{num_blocks:,} blocks of {fit.block_size} tokens ({gib(pool_bytes)}, from {flag}): "
        f"{pool_tokens:,} tokens"
    )
    room = max(0, fit.budget_bytes - fit.weight_bytes)
    if pool_bytes > room:
        fix = f"lower {flag} to {_flag_value(flag, room, fit.bytes_per_block)} or less"
        detail += f"; with the weights over {gib(fit.budget_bytes)}"
        return Check("kv pool", Status.FAIL, detail, fix)
    if pool_tokens < fit.max_seq_len:
        needed = _flag_value(flag, fit.kv_bytes, fit.bytes_per_block, round_up=True)
        return Check(
            "kv pool",
            Status.WARN,
            f"{detail}, fewer than max_seq_len {fit.max_seq_len:,}: longer requests are refused",
            f"raise {flag} to {needed}, or pass --max-seq-len {pool_tokens}",
        )
    at_once = pool_tokens // fit.max_seq_len
    return Check("kv pool", Status.OK, f"{detail}: {at_once:,} of max_seq_len at once")


def _flag_value(flag: str, num_bytes: int, bytes_per_block: int, round_up: bool = False) -> str:
    """`num_bytes` of KV pool as `flag` takes it: whole blocks, or MiB."""
    unit = bytes_per_block if flag == "--num-kv-blocks" else 2**20
    count = -(-num_bytes // unit) if round_up else num_bytes // unit
    return str(count) if flag == "--num-kv-blocks" else f"{count}MiB"
