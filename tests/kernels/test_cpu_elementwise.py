"""The CPU kernels around a step's products (`kernels/cpu/elementwise.cpp`): SiLU-and-mul, RMSNorm
with and without the residual add, and the rotary embedding in place each equal torch's formula (the
layers' own eager path) to float32 rounding, at widths with and without a SIMD tail, on rows of any
stride, the same bits on any number of threads; the layers take them on eager float32 CPU steps,
and traced graphs call them as ops but for the rotary (in place: eager only); inputs they cannot
read are errors, not wrong numbers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from metrale.config import RopeConfig
from metrale.kernels import cpu_extension
from metrale.layers.activation import silu_and_mul
from metrale.layers.layernorm import RMSNorm
from metrale.layers.rotary import FusedRotary, RotaryAngles, RotaryEmbedding
from tests.conftest import needs_cpu_kernels

pytestmark = needs_cpu_kernels
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def built():
    assert cpu_extension.available()


@pytest.fixture
def kernels_off(monkeypatch):
    """The layers' torch formulas: what the kernels are checked against."""

    def off() -> None:
        monkeypatch.setenv("METRALE_CPU_KERNELS", "0")

    return off


@pytest.mark.parametrize("rows, n", [(1, 16), (5, 40), (33, 1536)])
def test_silu_and_mul_equals_torch(rows, n):
    gate_up = torch.randn(rows, 2 * n) * 4
    want = F.silu(gate_up[:, :n]) * gate_up[:, n:]
    torch.testing.assert_close(cpu_extension.silu_and_mul(gate_up), want, **TOL)
    # Rows of a wider tensor (a stride past their width): each read where it lies.
    wide = torch.randn(rows, 2 * n + 8)
    torch.testing.assert_close(
        cpu_extension.silu_and_mul(wide[:, : 2 * n]),
        F.silu(wide[:, :n]) * wide[:, n : 2 * n],
        **TOL,
    )


def torch_rms_norm(x, residual, weight, eps):
    s = x if residual is None else x + residual
    return weight * F.rms_norm(s, (s.shape[-1],), eps=eps), s


@pytest.mark.parametrize("rows, n", [(1, 16), (7, 50), (64, 512)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_torch(rows, n, with_residual):
    x = torch.randn(rows, n) * 3
    residual = torch.randn(rows, n) if with_residual else None
    weight = torch.rand(n) + 0.5
    out, s = cpu_extension.rms_norm(x, residual, weight, 1e-6)
    want_out, want_s = torch_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)  # one add, rounded once


def test_rotary_in_place_equals_the_torch_rotation():
    # q, k as the attention layer splits them out of the qkv product: rows strided.
    tokens, heads, kv_heads, head_dim = 9, 4, 2, 48  # 24-value halves: a SIMD tail
    rope = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 63, 5, 40, 7, 7, 30])
    angles = RotaryAngles(*_angles(rope, positions))
    want_q, want_k = angles.rotate(q.clone()), angles.rotate(k.clone())
    cpu_extension.rotary_(q, k, rope.cos_cache, rope.sin_cache, positions)
    torch.testing.assert_close(q, want_q, **TOL)
    torch.testing.assert_close(k, want_k, **TOL)


def test_any_number_of_threads_gives_the_same_bits(torch_threads):
    # 100 rows: past the 16-row grain, so runs of rows are claimed by each thread there is
    rope = RotaryEmbedding(64, 256, RopeConfig(theta=10000.0))
    x, residual, weight = torch.randn(100, 512), torch.randn(100, 512), torch.rand(512) + 0.5
    gate_up, positions = torch.randn(100, 3072), torch.arange(100) * 2
    outs = []
    for threads in (1, 2, 3, 5):
        torch_threads(threads)
        q, k = torch.randn(100, 8, 64, generator=torch.Generator().manual_seed(0)).split([6, 2], 1)
        cpu_extension.rotary_(q, k, rope.cos_cache, rope.sin_cache, positions)
        outs.append(
            (
                cpu_extension.silu_and_mul(gate_up),
                *cpu_extension.rms_norm(x, residual, weight, 1e-6),
                q,
                k,
            )
        )
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0], strict=True))


def _angles(rope: RotaryEmbedding, positions: torch.Tensor):
    cos = rope.cos_cache[positions].unsqueeze(1)
    sin = rope.sin_cache[positions].unsqueeze(1)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def test_layers_take_the_kernels_on_eager_float32_cpu_steps(kernels_off):
    x = torch.randn(6, 32)
    residual = torch.randn(6, 32)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    rope = RotaryEmbedding(16, 32, RopeConfig(theta=10000.0))
    positions = torch.arange(6)
    assert cpu_extension.takes(x)
    assert isinstance(rope(positions, torch.float32), FusedRotary)
    assert not cpu_extension.takes(x.double())
    assert isinstance(rope(positions, torch.float64), RotaryAngles)
    heads = torch.randn(6, 2, 32)  # Qwen3's per-head norms: any rank
    got = (silu_and_mul(x), norm(x, residual), norm.norm(heads))
    kernels_off()
    assert not cpu_extension.takes(x)
    assert isinstance(rope(positions, torch.float32), RotaryAngles)
    want = (silu_and_mul(x), norm(x, residual), norm.norm(heads))
    torch.testing.assert_close(got, want, **TOL)


def test_traced_graphs_call_the_kernels_but_the_rotary():
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    norm = RMSNorm(32, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    rope = RotaryEmbedding(16, 32, RopeConfig(theta=10000.0))

    def step(gate_up, x, residual, heads, positions):
        angles = rope(positions, torch.float32)
        return silu_and_mul(gate_up), norm(x, residual), norm.norm(heads), angles.cos

    args = (torch.randn(4, 64), torch.randn(4, 32), torch.randn(4, 32), torch.randn(4, 2, 32))
    assert cpu_extension.takes(args[0])  # eagerly, as an engine asks while it loads
    got = torch.compile(step, backend=keep, fullgraph=True)(*args, torch.arange(4))
    (graph,) = graphs
    called = " ".join(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
    for op in ("silu_and_mul", "add_rms_norm", "rms_norm"):  # rms_norm: the per-head norms
        assert f"metrale_cpu.{op}" in called
    assert "rotary" not in called  # it writes q and k in place: eager steps only
    gate_up, x, residual, heads = args
    gate, up = gate_up.chunk(2, dim=-1)
    sum_ = x + residual
    want_norm = norm.weight * F.rms_norm(sum_, (32,), eps=1e-6)
    torch.testing.assert_close(got[0], F.silu(gate) * up, **TOL)
    torch.testing.assert_close(got[1], (want_norm, sum_), **TOL)
    torch.testing.assert_close(got[2], norm.weight * F.rms_norm(heads, (32,), eps=1e-6), **TOL)
    torch.testing.assert_close(got[3], _angles(rope, torch.arange(4))[0], **TOL)


def test_importing_the_layers_and_kernels_imports_neither_dynamo_nor_triton():
    # A CPU server starts without them; and triton imported before TRITON_INTERPRET is set (as
    # this suite sets it) defines its language's helpers uninterpreted, which broke every
    # interpreted kernel test after it when marking `enabled` constant imported dynamo.
    code = (
        "import sys, metrale.kernels.cpu_extension, metrale.layers.layernorm, "
        "metrale.layers.rotary, metrale.layers.activation; "
        "print([m for m in ('torch._dynamo', 'triton') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_inputs_it_cannot_read_are_errors():
    with pytest.raises(RuntimeError, match="float32"):
        cpu_extension.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="odd number"):
        cpu_extension.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="residual must be"):
        cpu_extension.rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_extension.rms_norm(torch.randn(2, 8), None, torch.ones(4), 1e-6)
    rope = RotaryEmbedding(16, 8, RopeConfig(theta=10000.0))
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    with pytest.raises(RuntimeError, match="past the tables"):
        cpu_extension.rotary_(q, k, rope.cos_cache, rope.sin_cache, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="a row of q and k each"):
        cpu_extension.rotary_(q, k, rope.cos_cache, rope.sin_cache, torch.tensor([0]))
