"""`store_kv` writes exactly the reference's slots, bit for bit, and nothing else."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.kv_store import store_kv, store_kv_ref

ON_GPU = torch.cuda.is_available()


def random_caches(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.randn(shape).to(dtype=dtype, device=device),
        torch.randn(shape).to(dtype=dtype, device=device),
    )


def random_slots(num_tokens: int, num_slots: int, num_skipped: int) -> torch.Tensor:
    """Distinct shuffled slots, `num_skipped` of them replaced by assorted negative values."""
    slots = torch.randperm(num_slots)[:num_tokens]
    skipped = torch.randperm(num_tokens)[:num_skipped]
    slots[skipped] = -torch.randint(1, 1000, (num_skipped,))
    return slots


def check_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slot_mapping)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    # Bit-exact: a copy, and every slot the reference leaves alone (skipped tokens) is intact.
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (2, 32), (3, 16)])
def test_matches_reference_and_skips_negative_slots(
    device: torch.device, dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(num_kv_heads * 100 + head_dim)
    num_blocks, block_size, num_tokens = 7, 4, 19
    k_cache, v_cache = random_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype=dtype, device=device)
    slots = random_slots(num_tokens, num_blocks * block_size, num_skipped=5).to(device)
    before_k = k_cache.clone()
    check_store(k, v, k_cache, v_cache, slots)
    # The cache really changed where slots are valid, and only there.
    changed = (k_cache != before_k).any(dim=(2, 3)).flatten()  # [num_slots]
    written = torch.zeros_like(changed)
    written[slots[slots >= 0]] = True
    assert torch.equal(changed, written)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_rounds_and_saturates(
    device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """An fp8 cache holds each value rounded to the format, outliers at its largest finite value
    (a plain cast would store nan or inf): bit for bit the reference's bytes."""
    torch.manual_seed(4)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 4, 2, 16, 11
    k_cache, v_cache = random_caches(
        num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device
    )
    k = 30 * torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    if not ON_GPU:
        # Triton 3.9's interpreter rounds to fp8 wrongly where rounding carries into the
        # exponent (7.9 -> 4): on the CPU the inputs are fp8 values already, so the test checks
        # addressing and saturation there, and rounding on the GPU, whose conversion is torch's.
        k, v = k.to(cache_dtype).float(), v.to(cache_dtype).float()
    k, v = k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device)
    limit = torch.finfo(cache_dtype).max
    k[0, 0, :2] = torch.tensor([2 * limit, -2 * limit]).clamp(-6e4, 6e4).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    stored = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()
    assert stored.isfinite().all()
    top = min(limit, 6e4)  # fp16 inputs cannot hold e5m2's largest value
    assert stored[0, 0, 0] == torch.tensor(top).to(cache_dtype).float() and stored[0, 0, 1] < 0
    torch.testing.assert_close(stored[1:], k[1:].float(), rtol=0.13, atol=2e-2)


def test_strided_rows_from_fused_qkv(device: torch.device) -> None:
    """k and v as column slices of a fused qkv output: row stride wider than a token's heads."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 16, 9
    k_cache, v_cache = random_caches(5, 4, num_kv_heads, head_dim, torch.float32, device)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=device)
    k = qkv[:, num_heads : num_heads + num_kv_heads]  # [num_tokens, num_kv_heads, head_dim]
    v = qkv[:, num_heads + num_kv_heads :]
    assert not k.is_contiguous()
    slots = random_slots(num_tokens, 20, num_skipped=2).to(device)
    check_store(k, v, k_cache, v_cache, slots)


def test_all_skipped_leaves_cache_untouched(device: torch.device) -> None:
    torch.manual_seed(2)
    k_cache, v_cache = random_caches(3, 4, 2, 16, torch.float32, device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(6, 2, 16, device=device)
    store_kv(k, k, k_cache, v_cache, torch.full((6,), -1, device=device))
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_no_tokens(device: torch.device) -> None:
    k_cache, v_cache = random_caches(3, 4, 2, 16, torch.float32, device)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 16, device=device)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(k_cache, before)


def test_rejects_int32_slots(device: torch.device) -> None:
    k_cache, v_cache = random_caches(3, 4, 2, 16, torch.float32, device)
    k = torch.randn(2, 2, 16, device=device)
    with pytest.raises(AssertionError, match="int64"):
        store_kv(k, k, k_cache, v_cache, torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_llama3_8b_shapes_bf16(device: torch.device) -> None:
    torch.manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 4096, 16, 8, 128, 8192
    k_cache, v_cache = random_caches(
        num_blocks, block_size, num_kv_heads, head_dim, torch.bfloat16, device
    )
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = random_slots(num_tokens, num_blocks * block_size, num_skipped=100).to(device)
    check_store(k, v, k_cache, v_cache, slots)
