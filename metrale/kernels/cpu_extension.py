"""The CPU kernels written in C++ (`kernels/cpu/*.cpp`), built on first use into one library whose
ops (`metrale_cpu::*`) eager code and compiled graphs call as they are:

- `packed_gemv`: one-row products over packed GGUF weights, Q8_0 / Q4_0 / Q4_1 blocks read as
  they lie (`kernels/quant_layout.py`), for the compiled one-row decode steps
  (`runner/compiled_decode.py`). A one-row step reads every weight once, so its time is the
  bytes it reads: served dequantized, SmolLM2-135M's Q4_1 file (97 MB) is 540 MB of float32 a
  step. Inductor's own loops over the nibbles did not vectorize (1-3 GB/s on 2 cores), and
  aten's int4 CPU product ran 0.8 GB/s; this kernel reads them at ~17 GB/s, per 32-value block
  `d * (q . x) + m * sum(x)` in float32 (the dequantized weight's values, only the order of the
  sums differs).
- `paged_decode_attention`: decode rows attending over the paged KV cache in place, one pass
  with an online softmax, for the eager steps of several decodes (`torch_backend.py`), which
  otherwise gather every row's blocks into a padded copy and then run SDPA over it, and for the
  compiled steps of several rows.
- `paged_prefill_attention`: the prompt chunks of an eager step attending over the paged cache
  in place, every chunk of the step in one call (the torch path gathers each chunk's blocks and
  runs SDPA a chunk at a time): a task is one KV head's query rows of a few tokens, held
  transposed so the online softmax works on a SIMD vector of rows at a time.
- `panel_linear`: float32 products of several rows (a decode step of several streams, a prompt's
  chunk) over a weight packed in panels of output columns (`pack_panels`, layers/linear.py),
  each panel streamed from memory once with its next rows prefetched: 2-16 rows of peers.md's
  33.6M Llama 1.4-1.6x oneDNN's prepacked product (bench/cpu_products.py), which reads the
  weights at ~2/3 of the bandwidth at those sizes.
- `store_kv`: a compiled decode step's keys and values written to their slots of the pool, one
  call a layer (the torch formula's two `index_copy_` through views took 37-54 us a call, most
  of it dispatch).
- `tempered_inverse_cdf`: a sampled row's token drawn from its float32 logits and temperature
  (`runner/inverse_cdf.py`), three passes over the row where torch's formula makes six, four
  of them writing row-sized tensors (16 rows of a 151,936-token vocabulary: ~5-17 ms a step).
- `silu_and_mul`, `rms_norm` / `add_rms_norm` and `rotary_`: the operators around the products
  of an eager step (prompts chiefly), each one pass where torch takes two to five (`takes` says
  where they run).

They are compiled by torch's C++ extension builder (g++ and ninja, `-O3 -march=native
-fopenmp`: ~30 s on 2 cores), cached on disk per machine kind (`~/.cache/torch_extensions`).
`available()` is False where they cannot be built (no compiler): the callers then take their
torch paths.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import platform
from collections.abc import Iterator
from pathlib import Path

import torch

from metrale import envs
from metrale.kernels.quant_layout import FORMAT_IDS

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
_HEADERS = sorted((Path(__file__).parent / "cpu").glob("*.h"))  # in the name's digest too
_traceable = False  # the ops' fake (tracing) implementations are registered
# The caches `paged_decode_attention` reads (fp8 ones stay on the torch path).
_ATTENDED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo's line; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _machine_tag() -> str:
    """A short hash of what `-march=native` compiles for: the build is cached per machine kind."""
    return hashlib.sha256(f"{platform.machine()} {_cpu_flags()}".encode()).hexdigest()[:10]


def _vector_width() -> list[str]:
    """The defines that give at::vec the SIMD width of this machine (as ATen's own per-CPU
    builds define them; without them it falls back to plain loops): AVX-512 or AVX2."""
    flags = set(_cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


_enabled_when_asked = False  # enabled()'s last answer: what a graph being traced takes (`takes`)


def enabled() -> bool:
    """Whether the CPU kernels run: built (`available`) and not turned off by
    METRALE_CPU_KERNELS=0."""
    global _enabled_when_asked
    _enabled_when_asked = envs.cpu_kernels() and available()
    return _enabled_when_asked


def extension_name() -> str:
    """The kernels' name for torch's builder: a new one for new sources or another CPU kind."""
    sources = b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
    digest = hashlib.sha256(sources).hexdigest()[:10]
    return f"metrale_cpu_{digest}_{_machine_tag()}"


@functools.cache
def available() -> bool:
    """Whether the kernels are built and their ops registered (built now if need be, once a
    process)."""
    from torch.utils.cpp_extension import load

    name = extension_name()
    logger.info("loading Metrale's CPU kernels (built once a machine, ~30 s)")
    try:
        with _build_lock(name):
            load(
                name,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", *_vector_width()],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a failed build: whatever the builder raises
        logger.warning(
            "could not build Metrale's CPU kernels (packed GGUF products, paged decode "
            "attention); the torch paths run instead: %s: %s",
            type(e).__name__,
            str(e).strip().splitlines()[0] if str(e).strip() else "",
        )
        return False
    global _traceable
    if not _traceable:  # once a process, however often the build is looked up again
        torch.library.register_fake("metrale_cpu::packed_gemv")(_fake_gemv)
        torch.library.register_fake("metrale_cpu::paged_decode_attention")(_fake_attention)
        torch.library.register_fake("metrale_cpu::store_kv")(_fake_store)
        torch.library.register_fake("metrale_cpu::panel_linear")(_fake_panel_linear)
        torch.library.register_fake("metrale_cpu::silu_and_mul")(_fake_silu_and_mul)
        torch.library.register_fake("metrale_cpu::rms_norm")(_fake_rms_norm)
        torch.library.register_fake("metrale_cpu::add_rms_norm")(_fake_add_rms_norm)
        _traceable = True
    return True


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Hold extension `name`'s build directory while torch builds or loads it.

    torch's own lock there is a file that it creates and deletes: a process killed while it
    held it (Ctrl-C during the first start's ~30 s build) leaves it behind, and every later
    load of the extension then waits on it forever, so `met serve` hung at startup. This lock is
    an flock, which the OS drops with its holder; whoever holds it deletes a lock file torch
    left, which no live process can own, since every builder of these kernels takes this lock
    first."""
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory

        directory = Path(_get_build_directory(name, verbose=False))
    except (ImportError, AttributeError):  # no flock (Windows), or torch moved its helper
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "metrale.flock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that was stopped", stale)
            stale.unlink(missing_ok=True)
        yield


def _fake_gemv(x, qweight, scales, mins, fmt):
    """The op's output, for tracing: [rows of x, rows of the weight]."""
    return x.new_empty((x.shape[0], scales.shape[0]))


def _fake_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window):
    """The op's output, for tracing: q's shape, contiguous."""
    return q.new_empty(q.shape)


def _fake_panel_linear(x, panels, bias, n):
    """The op's output, for tracing: [rows of x, n]."""
    return x.new_empty((x.shape[0], n))


def _fake_silu_and_mul(gate_up):
    """The ops' outputs, for tracing: new contiguous tensors."""
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _fake_rms_norm(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_add_rms_norm(x, residual, weight, eps):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
    )


def _fake_store(kv, layer, slot_mapping, k, v):
    """The op's output, for tracing: none (it writes the pool)."""
    return None


def packed_gemv(
    x: torch.Tensor, fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """x [1, K] float32 @ dequant(weight).T, the weight's parts as `PackedWeight` holds them."""
    return torch.ops.metrale_cpu.packed_gemv(x, qweight, scales, mins, FORMAT_IDS[fmt])


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] as `panel_linear` reads it: [ceil(N / L), K, L], L the machine's
    float32 lanes, panel p's row k the weights of columns p * L ... p * L + L - 1 at input k."""
    return torch.ops.metrale_cpu.pack_panels(weight.detach().contiguous())


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x float32 [rows, K] @ W.T (+ bias) for W [n, K] packed by `pack_panels`: [rows, n]."""
    return torch.ops.metrale_cpu.panel_linear(x, panels, bias, n)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Each row of q ([rows, heads, D]) attending over the first `seq_lens[i]` slots of its
    block table (int64 [rows, max_blocks]) in the caches ([blocks, block_size, kv_heads, D], q's
    dtype: float32, bfloat16 or float16; sums in float32), the last `sliding_window` of them if
    set: [rows, heads, D]."""
    return torch.ops.metrale_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0
    )


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    start_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Prompt chunks attending over the paged caches, written into `out`'s rows of them: chunk i
    is q's rows `query_starts[i]` onward (`query_lens[i]` tokens, [tokens, heads, D]) at positions
    `start_positions[i]` onward, its keys already stored; each token sees its sequence's slots
    (block table int64 [seqs, max_blocks]) up to its own position, the last `sliding_window` of
    them if set. Dtypes and layouts as `paged_decode_attention`'s; rows of q outside the chunks
    are left as they are in `out`."""
    torch.ops.metrale_cpu.paged_prefill_attention(
        out, q, k_cache, v_cache, block_tables, query_starts, query_lens, start_positions, scale,
        sliding_window or 0,
    )  # fmt: skip


def attends_in_place(cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decode rows over a cache of `cache_dtype` attend through `paged_decode_attention`:
    the kernels on, a float32, bfloat16 or float16 cache (not fp8), a head size of a multiple of
    its 16 lanes."""
    return cache_dtype in _ATTENDED_DTYPES and head_dim % 16 == 0 and enabled()


def takes(x: torch.Tensor) -> bool:
    """Whether code on `x` runs the elementwise kernels (`silu_and_mul`, `rms_norm`, `rotary_`): a
    float32 CPU tensor and the kernels on. Compiled decode steps call `silu_and_mul` and the norms
    as they are too (in place of inductor's fusions of torch's formulas; the SiLU ~18 against
    ~36 us a layer at 16 rows by the profiler, the whole step within the noise); `rotary_`, which
    writes q and k in place, only eager steps (`RotaryEmbedding.forward`)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    # A graph being traced takes the answer the eager steps before it got (the engine asks while
    # it loads): dynamo cannot trace the build's cache, and marking `enabled` constant for it
    # would import dynamo, and with it triton, wherever this module is imported.
    return _enabled_when_asked if torch.compiler.is_compiling() else enabled()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * n] -> silu(gate) * up [tokens, n]."""
    return torch.ops.metrale_cpu.silu_and_mul(gate_up)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(x + residual), x + residual) over rows [tokens, features]; without a
    residual, (weight * norm(x), x)."""
    if residual is None:
        return torch.ops.metrale_cpu.rms_norm(x, weight, eps), x
    return torch.ops.metrale_cpu.add_rms_norm(x, residual, weight, eps)


def rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Rotate q [tokens, heads, D] and k [tokens, kv_heads, D] in place to `positions` (int64),
    the tables [max_positions, D] float32 (the "rotate half" layout)."""
    torch.ops.metrale_cpu.rotary_(q, k, cos_cache, sin_cache, positions)
