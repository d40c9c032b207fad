"""What this directory's scripts share: peers.md's 33.6M Llama (profile_cpu.py's checkpoint), an
engine over it as the decode benchmarks build one, and `met serve` over it as peer_cpu.py starts
it. Run the scripts from /tmp with metrale importable (README.md)."""

import sys
from pathlib import Path

sys.path.insert(0, "/work/main/bench")
from peer_cpu import commands, free_port, text_prompts
from profile_cpu import checkpoint

from metrale import LLM

MODEL = checkpoint(Path("/work/main/bench/.cache/llama-34m"))


def engine() -> LLM:
    """The engine alone, every prompt of a 16-stream wave in one prefill step."""
    return LLM(
        str(MODEL),
        dtype="float32",
        max_seq_len=2048,
        enable_prefix_caching=False,
        max_prefill_tokens=2048,
    )


class _Args:
    dtype = "float32"
    vllm_python = None
    llamacpp_python = None


def serve_command(extra: list[str]) -> tuple[list[str], int, list[str]]:
    """`met serve`'s command line as peer_cpu.py runs it (plus `extra`), its port, and peer_cpu's
    32 prompts."""
    port = free_port()
    return commands(MODEL, None, port, _Args)["metrale"] + extra, port, text_prompts(MODEL, 32)


def cpu_seconds(process) -> float:
    """A psutil process's CPU time so far, user and system."""
    times = process.cpu_times()
    return times.user + times.system
