"""On a CPU the loader packs every dense linear layer for the product its rows go through
(`prepack_for_cpu`): a float32 weight into panels for Metrale's kernel where the CPU kernels
build, any other (or with METRALE_CPU_KERNELS=0) into oneDNN's layout where oneDNN takes its
dtype on this CPU (bfloat16 needs AVX-512; on an AVX2 CPU torch's product takes it). The dense
weight is dropped, `state_dict` still gives it back, a tied head keeps the embedding, and the
products equal torch's own to float32 rounding, so the greedy tokens do not change."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import ModelConfig
from metrale.kernels import cpu_extension
from metrale.layers.linear import ONEDNN_LAYOUT_ROWS, Linear, onednn_packs
from metrale.runner.model_loader import load_model
from tests.conftest import build_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)
CPU = torch.device("cpu")
# METRALE_ONEDNN=0: torch's own products; METRALE_CPU_KERNELS=0: oneDNN's; neither: the panels
# (float32, where the kernels build)
PRODUCTS = {
    "torch": {"METRALE_ONEDNN": "0"},
    "onednn": {"METRALE_CPU_KERNELS": "0"},
    "panels": {},
}


def linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def layout(model: torch.nn.Module) -> str:
    """Which product every linear layer of `model` runs (one for all of them)."""
    kinds = {
        "panels" if m.panels is not None else "onednn" if m.onednn is not None else "torch"
        for m in linears(model)
    }
    assert len(kinds) == 1, kinds
    assert all((m.weight is None) == (kinds != {"torch"}) for m in linears(model))
    return kinds.pop()


def expected(products: str, dtype: torch.dtype) -> str:
    if products == "panels" and (dtype != torch.float32 or not cpu_extension.enabled()):
        return "onednn"
    return products


@pytest.mark.parametrize("products", ["panels", "onednn"])
@pytest.mark.parametrize("tied", [False, True])
def test_loaded_on_cpu_every_linear_layer_is_packed(tmp_path, tied, products, monkeypatch) -> None:
    model_dir = build_checkpoint(tmp_path, "qwen2", tie_word_embeddings=tied)  # biases too
    config = ModelConfig.from_dir(model_dir)
    for name, value in PRODUCTS[products].items():
        monkeypatch.setenv(name, value)
    model = load_model(model_dir, config, dtype=torch.float32, device=CPU, progress=False)
    assert layout(model) == expected(products, torch.float32)
    assert model.model.embed_tokens.weight is not None  # a tied head's packing keeps it
    monkeypatch.setenv("METRALE_ONEDNN", "0")
    plain = load_model(model_dir, config, dtype=torch.float32, device=CPU, progress=False)
    assert layout(plain) == "torch"
    assert ("lm_head.weight" in dict(plain.named_parameters())) != tied  # tied: one parameter
    ours, theirs = model.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    for rows in (1, 5, 17, 300):
        x = torch.randn(rows, config.hidden_size)
        batched = torch.randn(2, 3, config.hidden_size)
        for a, b in zip(linears(model), linears(plain), strict=True):
            if a.in_features == config.hidden_size:
                torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)
                # a batch of sequences [batch, tokens, features] as well as rows
                torch.testing.assert_close(a(batched), b(batched), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_onednn_is_said_to_pack_a_dtype_exactly_where_it_does(dtype) -> None:
    # Its 16-bit layouts need AVX-512 (or AVX-NE-CONVERT): on an AVX2-only CPU it refuses them.
    weight = torch.randn(32, 16).to(dtype)
    if onednn_packs(dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_LAYOUT_ROWS)
        x = torch.randn(3, 16).to(dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        torch.testing.assert_close(out, x @ weight.T, rtol=2e-2, atol=2e-2)
    else:
        with pytest.raises(RuntimeError, match="needs the cpu support"):
            torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_LAYOUT_ROWS)


def test_a_bfloat16_model_goes_through_onednn_where_it_packs_bfloat16(tmp_path) -> None:
    model_dir = build_checkpoint(tmp_path, "llama")
    config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, config, dtype=torch.bfloat16, device=CPU, progress=False)
    assert layout(model) == ("onednn" if onednn_packs(torch.bfloat16) else "torch")
    x = torch.randn(5, config.hidden_size, dtype=torch.bfloat16)
    layer = model.model.layers[0].mlp.gate_up_proj
    dense = torch.nn.functional.linear(x, layer.state_dict()["weight"])
    torch.testing.assert_close(layer(x), dense, rtol=2e-2, atol=2e-2)


def test_greedy_tokens_are_those_of_torchs_products(tmp_path, monkeypatch) -> None:
    model_dir = build_checkpoint(tmp_path, "llama")
    prompts = [list(range(10, 40)), list(range(50, 57))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for products in ("panels", "onednn", "torch"):
        with monkeypatch.context() as env:
            for name, value in PRODUCTS[products].items():
                env.setenv(name, value)
            llm = LLM(model_from_path=str(model_dir), dtype="float32")
            assert layout(llm.engine.runner.model) == expected(products, torch.float32)
            outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outputs])
    assert runs[0] == runs[1] == runs[2]
