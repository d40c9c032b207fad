"""Compile every Triton kernel for the H200 (sm_90) as its wrapper would launch it, without a GPU.

Run by test_compile_for_hopper.py in a process of its own: the kernels must be defined without
TRITON_INTERPRET (which the other kernel tests set) to reach Triton's real compiler and ptxas.
Each wrapper runs on CPU tensors with its kernels swapped for recorders; every recorded launch is
then compiled for sm_90 with the arguments, constexprs and launch options it was given, and
with programmatic dependent launch on, as a Hopper GPU runs it. Prints one line per compile.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from metrale.kernels import (
    gemv,
    kv_store,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rotary,
    rotary_kv_store,
    silu_and_mul,
)

HOPPER = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
    torch.int64: "*i64",
    torch.int32: "*i32",
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
KERNELS = {
    gemv: ["_gemv_kernel"],
    kv_store: ["_store_kv_kernel"],
    paged_decode_attention: ["_paged_decode_split_kernel", "_paged_decode_reduce_kernel"],
    paged_prefill_attention: ["_paged_prefill_kernel"],
    rms_norm: ["_rms_norm_kernel"],
    rotary: ["_rotary_kernel"],
    rotary_kv_store: ["_rotary_kv_store_kernel"],
    silu_and_mul: ["_silu_and_mul_kernel"],
}
launches: list[tuple[triton.runtime.jit.JITFunction, tuple, dict]] = []


class Recorder:
    def __init__(self, kernel: triton.runtime.jit.JITFunction) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))


def compile_for_hopper(kernel, args: tuple, kwargs: dict) -> str:
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    options = {k: values.pop(k) for k in LAUNCH_OPTIONS if k in values}
    if "PDL" in values:
        values["PDL"] = options["launch_pdl"] = True
    signature, constexprs = {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
    triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER, options=options)
    shown = {kernel.params[i].name: v for (i,), v in constexprs.items()}
    return f"{kernel.__name__} {shown}"


def run_wrappers() -> None:
    """One call of each wrapper per variant the engine uses, on CPU tensors (nothing launches)."""
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    tokens, heads, kv_heads, dim = 24, 32, 8, 128
    x = torch.randn(1, 4096, dtype=bf16)
    gemv.gemv(x, torch.randn(6144, 4096, dtype=bf16))
    gemv.gemv(
        torch.randn(1, 2 * 1024, dtype=bf16), torch.randn(4096, 1024, dtype=bf16), silu_and_mul=True
    )
    hidden = torch.randn(tokens, 4096, dtype=bf16)
    rms_norm.rms_norm(hidden, torch.ones(4096, dtype=bf16), 1e-5, hidden.clone())
    silu_and_mul.silu_and_mul(torch.randn(tokens, 2 * 1024, dtype=bf16))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=bf16)
    q, k, v = (
        t.view(tokens, -1, dim)
        for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    )
    cos = sin = torch.randn(4096, dim)
    positions = torch.arange(tokens)
    rotary.apply_rotary(q, k, cos, sin, positions, q_out=q, k_out=k)
    slots = torch.arange(tokens)
    block_tables = torch.arange(8).view(2, 4)
    for cache_dtype in (bf16, fp8):
        caches = [torch.empty(8, 16, kv_heads, dim, dtype=cache_dtype) for _ in range(2)]
        kv_store.store_kv(k, v, *caches, slots)
        rotary_kv_store.rotary_kv_store(q, k, v, cos, sin, positions, *caches, slots)
        norms = (torch.ones(dim, dtype=bf16), torch.ones(dim, dtype=bf16), 1e-6)
        rotary_kv_store.rotary_kv_store(q, k, v, cos, sin, positions, *caches, slots, norms)
        paged_decode_attention.paged_decode_attention(
            q[:2], *caches, block_tables, torch.tensor([40, 64]), dim**-0.5
        )
        paged_prefill_attention.paged_prefill_attention(
            q,
            *caches,
            block_tables,
            torch.tensor([0, 8, 24]),
            torch.tensor([40, 64]),
            16,
            dim**-0.5,
        )
    paged_decode_attention.paged_decode_attention(
        q[:2], *caches, block_tables, torch.tensor([40, 64]), dim**-0.5, sliding_window=32
    )


def main() -> int:
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, Recorder(getattr(module, name)))
    run_wrappers()
    seen = set()
    for kernel, args, kwargs in launches:
        line = compile_for_hopper(kernel, args, kwargs)
        if line not in seen:
            seen.add(line)
            print("compiled", line, flush=True)
    compiled = {line.split()[0] for line in seen}
    missing = {n for names in KERNELS.values() for n in names} - compiled
    if missing:
        print("never launched:", sorted(missing))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
