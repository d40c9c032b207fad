"""The rotary kernel against `apply_rotary_ref`, on q/k views of one fused qkv tensor."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.rotary import apply_rotary, apply_rotary_ref

ON_GPU = torch.cuda.is_available()
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]
# (num_q_heads, num_kv_heads, head_dim): GQA with power-of-two sizes, then head counts and a
# half head_dim (12) that are not powers of two, so every mask is exercised.
HEAD_CONFIGS = [(4, 2, 32), (6, 1, 24)]
if ON_GPU:
    HEAD_CONFIGS += [(32, 8, 128), (28, 4, 128), (40, 8, 80)]
NUM_TOKENS = [1, 7, 33]
MAX_POSITIONS = 64
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def rotary_caches(
    head_dim: int, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in fp32, columns cat(freqs, freqs)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (500_000.0**exponents)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    return emb.cos(), emb.sin()


def random_positions(num_tokens: int, max_positions: int, device: torch.device) -> torch.Tensor:
    positions = torch.randint(0, max_positions, (num_tokens,), device=device)
    positions[0] = max_positions - 1  # the last row of the cache is reachable
    return positions


def fused_qkv(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv, q, k): q and k are views of qkv, as the model gets them from its fused projection."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=device).to(dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        qkv,
        q.view(num_tokens, num_q_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "the kernel left elements unwritten (NaN poison remains)"
    tol = 1e-5 if actual.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_out_of_place_from_fused_qkv(
    device: torch.device, dtype: torch.dtype, heads: tuple[int, int, int], num_tokens: int
) -> None:
    num_q_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(num_tokens * 100 + head_dim)
    qkv, q, k = fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device)
    if num_tokens > 1:  # (a view with one token gets the strides of a contiguous tensor)
        assert q.stride(0) == k.stride(0) == qkv.shape[1], "q and k must be views into qkv"
    qkv_before = qkv.clone()
    cos, sin = rotary_caches(head_dim, MAX_POSITIONS, device)
    positions = random_positions(num_tokens, MAX_POSITIONS, device)
    q_out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    k_out = torch.full(k.shape, float("nan"), dtype=dtype, device=device)
    got_q, got_k = apply_rotary(q, k, cos, sin, positions, q_out=q_out, k_out=k_out)
    want_q, want_k = apply_rotary_ref(q, k, cos, sin, positions)
    assert got_q is q_out and got_k is k_out
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)
    assert torch.equal(qkv, qkv_before), "out of place must leave q, k and v untouched"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
def test_in_place_on_fused_qkv(
    device: torch.device, dtype: torch.dtype, heads: tuple[int, int, int]
) -> None:
    num_q_heads, num_kv_heads, head_dim = heads
    num_tokens = 5
    torch.manual_seed(head_dim)
    qkv, q, k = fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device)
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()
    cos, sin = rotary_caches(head_dim, MAX_POSITIONS, device)
    # No position 0 (the identity rotation), so an unwritten element would show.
    positions = torch.randint(1, MAX_POSITIONS, (num_tokens,), device=device)
    want_q, want_k = apply_rotary_ref(q, k, cos, sin, positions)
    got_q, got_k = apply_rotary(q, k, cos, sin, positions, q_out=q, k_out=k)
    assert got_q is q and got_k is k
    assert_matches(q, want_q)
    assert_matches(k, want_k)
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], v_before)


def test_allocates_contiguous_outputs_by_default(device: torch.device) -> None:
    torch.manual_seed(0)
    _, q, k = fused_qkv(3, 4, 2, 32, torch.float32, device)
    cos, sin = rotary_caches(32, MAX_POSITIONS, device)
    positions = random_positions(3, MAX_POSITIONS, device)
    got_q, got_k = apply_rotary(q, k, cos, sin, positions)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    want_q, want_k = apply_rotary_ref(q, k, cos, sin, positions)
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)


def test_arbitrary_token_and_head_strides(device: torch.device) -> None:
    """q head-major (token stride head_dim), k with a gap between heads, outputs strided too."""
    torch.manual_seed(1)
    num_tokens, head_dim = 5, 16
    q = torch.randn(4, num_tokens, head_dim, device=device).transpose(0, 1)
    k = torch.randn(num_tokens, 2, 3 * head_dim, device=device)[:, :, head_dim : 2 * head_dim]
    q_out = torch.full((4, num_tokens, head_dim), float("nan"), device=device).transpose(0, 1)
    k_out = torch.full((num_tokens, 2, 2 * head_dim), float("nan"), device=device)[..., :head_dim]
    cos, sin = rotary_caches(head_dim, MAX_POSITIONS, device)
    positions = random_positions(num_tokens, MAX_POSITIONS, device)
    apply_rotary(q, k, cos, sin, positions, q_out=q_out, k_out=k_out)
    want_q, want_k = apply_rotary_ref(q, k, cos, sin, positions)
    assert_matches(q_out, want_q)
    assert_matches(k_out, want_k)


def test_rejects_bad_inputs(device: torch.device) -> None:
    _, q, k = fused_qkv(3, 4, 2, 32, torch.float32, device)
    cos, sin = rotary_caches(32, MAX_POSITIONS, device)
    positions = random_positions(3, MAX_POSITIONS, device)
    with pytest.raises(AssertionError, match="int64"):
        apply_rotary(q, k, cos, sin, positions.int())
    with pytest.raises(AssertionError, match="fp32"):
        apply_rotary(q, k, cos.half(), sin.half(), positions)
    with pytest.raises(AssertionError, match="contiguous head_dim"):
        apply_rotary(q.transpose(1, 2), k, cos, sin, positions)
    with pytest.raises(AssertionError, match="like q"):
        apply_rotary(q, k.half(), cos, sin, positions)
    with pytest.raises(AssertionError, match="positions is"):
        apply_rotary(q, k, cos, sin, positions[:2])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("num_tokens", [1, 17, 256, 8192])
def test_llama3_8b_shapes(num_tokens: int) -> None:
    """32 q heads, 8 kv heads, head_dim 128, bf16, rotated in place in the fused qkv."""
    torch.manual_seed(num_tokens)
    device = torch.device("cuda")
    max_positions = 8192
    _, q, k = fused_qkv(num_tokens, 32, 8, 128, torch.bfloat16, device)
    cos, sin = rotary_caches(128, max_positions, device)
    positions = random_positions(num_tokens, max_positions, device)
    want_q, want_k = apply_rotary_ref(q, k, cos, sin, positions)
    apply_rotary(q, k, cos, sin, positions, q_out=q, k_out=k)
    assert_matches(q, want_q)
    assert_matches(k, want_k)


@pytest.mark.gpu
@requires_gpu
def test_cuda_graph_capture() -> None:
    device = torch.device("cuda")
    num_tokens, max_positions = 64, 8192
    qkv, q, k = fused_qkv(num_tokens, 32, 8, 128, torch.bfloat16, device)
    cos, sin = rotary_caches(128, max_positions, device)
    positions = random_positions(num_tokens, max_positions, device)
    apply_rotary(q, k, cos, sin, positions)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = apply_rotary(q, k, cos, sin, positions)
    qkv.copy_(torch.randn_like(qkv))
    positions.copy_(random_positions(num_tokens, max_positions, device))
    graph.replay()
    torch.cuda.synchronize()
    want_q, want_k = apply_rotary_ref(q, k, cos, sin, positions)
    assert_matches(q_out, want_q)
    assert_matches(k_out, want_k)
