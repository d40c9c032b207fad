"""Experiment: spend the HBM's idle time inside a batch-1 decode step loading the next weight
into L2.

A Llama-3.1-8B-shaped decode step in plain torch ops (as ../shared/device-notes.md measured it:
one CUDA graph of 32 layers), with and without a side stream that, while the small kernels of a
layer run (rotary, attention, norms, activation), reads the weight of the next matrix-vector
product with an evict-last policy, so the product finds it in L2. Reports ms per step for each
variant and the fraction of the read roofline.

The `bulk_*` variants (Hopper) instead launch, on the step's own stream, a kernel that only
issues `cp.async.bulk.prefetch.L2` for the weight and exits: the copy engine streams the weight
into L2 while the small kernels after it run, with no SM reading it and no second stream.
Measured on an H100 (2026-12-07, bench/results/h100-2026-12-07-stop61/): every variant slower
than none (`bulk_o` 7.41 against 6.37 ms; in the engine, B1 -15.5%), so none is in the engine.

    python bench/b1_l2_prefetch.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from cuda_timing import copy_bandwidth, graph_seconds

from metrale.kernels.grid import cdiv

H, FFN, NH, NKV, D, LAYERS, VOCAB, CONTEXT = 4096, 14336, 32, 8, 128, 32, 128256, 640


@triton.jit
def _prefetch_kernel(ptr, num_elements, sink_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, num_elements, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + offs, mask=offs < num_elements, other=0.0, eviction_policy="evict_last")
        acc += x.to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc, 0))


BULK_CHUNK = 65536  # bytes a thread asks the copy engine to bring into L2
# A constexpr: a jitted function may read no other kind of global.
_BULK_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
    f"@p cp.async.bulk.prefetch.L2.global [$1], {BULK_CHUNK}; mov.u32 $0, 0; }}"
)


@triton.jit
def _bulk_prefetch_kernel(ptr, num_chunks, CHUNK_ELEMENTS: tl.constexpr, THREADS: tl.constexpr):
    chunk = tl.program_id(0) * THREADS + tl.arange(0, THREADS)
    wanted = (chunk < num_chunks).to(tl.int32)
    addresses = ptr + chunk.to(tl.int64) * CHUNK_ELEMENTS
    tl.inline_asm_elementwise(
        _BULK_ASM, "=r,l,r", [addresses, wanted], dtype=tl.int32, is_pure=False, pack=1
    )


def bulk_prefetch(weight: torch.Tensor, share: float) -> None:
    """Ask for the first `share` of `weight` (whole chunks) in L2, and return at once."""
    num_chunks = int(weight.numel() * weight.element_size() * share) // BULK_CHUNK
    threads = 128
    grid = (max(1, cdiv(num_chunks, threads)),)
    chunk_elements = BULK_CHUNK // weight.element_size()
    _bulk_prefetch_kernel[grid](weight, num_chunks, chunk_elements, threads, num_warps=4)


class Step:
    def __init__(self, prefetch: dict[str, float], programs: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)

        def w(*shape):
            return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02

        self.layers = [
            {
                "qkv": w((NH + 2 * NKV) * D, H),
                "o": w(H, NH * D),
                "gate_up": w(2 * FFN, H),
                "down": w(H, FFN),
                "n1": torch.ones(H, device="cuda", dtype=torch.bfloat16),
                "n2": torch.ones(H, device="cuda", dtype=torch.bfloat16),
                "k": w(1, NKV, CONTEXT, D),
                "v": w(1, NKV, CONTEXT, D),
            }
            for _ in range(LAYERS)
        ]
        self.head = w(VOCAB, H)
        self.x = w(1, H)
        self.prefetch = prefetch  # matrix name -> share of it to prefetch
        self.programs = programs
        self.sink = torch.empty(programs, device="cuda", dtype=torch.float32)
        self.side = torch.cuda.Stream()
        self.weight_bytes = (
            sum(
                t.numel() * 2
                for layer in self.layers
                for n, t in layer.items()
                if n in ("qkv", "o", "gate_up", "down")
            )
            + self.head.numel() * 2
        )

    def _prefetch(self, name: str, weight: torch.Tensor) -> None:
        share = self.prefetch.get(name, 0.0)
        if share <= 0:
            return
        if self.prefetch.get("bulk"):
            bulk_prefetch(weight, share)
            return
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        self.forked = True
        with torch.cuda.stream(self.side):
            n = int(weight.numel() * share)
            _prefetch_kernel[(self.programs,)](weight, n, self.sink, BLOCK=8192, num_warps=8)

    def __call__(self) -> torch.Tensor:
        self.forked = False
        x = self.x
        for i, layer in enumerate(self.layers):
            nxt = self.layers[(i + 1) % LAYERS]
            h = F.rms_norm(x, (H,), layer["n1"])
            qkv = h @ layer["qkv"].t()
            self._prefetch("o", layer["o"])
            q = qkv[:, : NH * D].view(1, NH, 1, D)
            attn = F.scaled_dot_product_attention(q, layer["k"], layer["v"], enable_gqa=True)
            x = x + attn.reshape(1, NH * D) @ layer["o"].t()
            h = F.rms_norm(x, (H,), layer["n2"])
            self._prefetch("gate_up", layer["gate_up"])
            gu = h @ layer["gate_up"].t()
            self._prefetch("down", layer["down"])
            a = F.silu(gu[:, :FFN]) * gu[:, FFN:]
            x = x + a @ layer["down"].t()
            self._prefetch("qkv", nxt["qkv"])
        out = (F.rms_norm(x, (H,)) @ self.head.t()).argmax(-1)
        if self.forked:  # join the side stream (a capture must end on its origin stream)
            torch.cuda.current_stream().wait_stream(self.side)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    copy = copy_bandwidth()
    variants = {
        "none": ({}, 64),
        "o": ({"o": 1.0}, 64),
        "o_96": ({"o": 1.0}, 96),
        "o_32": ({"o": 1.0}, 32),
        "o+0.1": ({"o": 1.0, "gate_up": 0.05, "down": 0.1, "qkv": 0.2}, 64),
        "o+0.2": ({"o": 1.0, "gate_up": 0.1, "down": 0.2, "qkv": 0.4}, 64),
        "all_small": ({"gate_up": 0.05, "down": 0.1, "qkv": 0.2}, 64),
        "bulk_o": ({"bulk": 1, "o": 1.0}, 0),
        "bulk_o_half": ({"bulk": 1, "o": 0.5}, 0),
        "bulk_o+qkv0.2": ({"bulk": 1, "o": 1.0, "qkv": 0.2}, 0),
        "bulk_o+gate_up0.05": ({"bulk": 1, "o": 1.0, "gate_up": 0.05}, 0),
        "none_again": ({}, 64),
    }
    results: dict = {"copy_tb_per_s": copy / 1e12, "device": torch.cuda.get_device_name()}
    for name, (prefetch, programs) in variants.items():
        step = Step(prefetch, max(programs, 1))
        try:
            seconds = graph_seconds(step)
        except Exception as e:  # a variant the device or the compiler refuses
            print(f"{name:10s} failed: {type(e).__name__}: {str(e)[:300]}")
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        roofline = step.weight_bytes / copy
        results[name] = {"ms": seconds * 1e3, "fraction_of_roofline": roofline / seconds}
        print(f"{name:10s} {seconds * 1e3:6.3f} ms  {100 * roofline / seconds:5.1f}% of roofline")
        del step
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "b1_l2_prefetch.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
