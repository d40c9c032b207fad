"""On a CPU the loader prepacks every dense linear layer for oneDNN (`prepack_for_cpu`): the dense
weight is dropped, `state_dict` still gives it back, a tied head keeps the embedding, and the
products equal torch's own to float32 rounding, so the greedy tokens do not change."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import ModelConfig
from metrale.layers.linear import Linear
from metrale.runner.model_loader import load_model
from tests.conftest import build_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)
CPU = torch.device("cpu")


def linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("tied", [False, True])
def test_loaded_on_cpu_every_linear_layer_is_prepacked(tmp_path, tied, monkeypatch) -> None:
    model_dir = build_checkpoint(tmp_path, "qwen2", tie_word_embeddings=tied)  # biases too
    config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, config, dtype=torch.float32, device=CPU, progress=False)
    assert all(m.onednn is not None and m.weight is None for m in linears(model))
    assert model.model.embed_tokens.weight is not None  # a tied head's prepacking keeps it
    monkeypatch.setenv("METRALE_ONEDNN", "0")
    plain = load_model(model_dir, config, dtype=torch.float32, device=CPU, progress=False)
    assert all(m.onednn is None and m.weight is not None for m in linears(plain))
    assert ("lm_head.weight" in dict(plain.named_parameters())) != tied  # tied: one parameter
    ours, theirs = model.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    for rows in (1, 5, 300):
        x = torch.randn(rows, config.hidden_size)
        for a, b in zip(linears(model), linears(plain), strict=True):
            if a.in_features == config.hidden_size:
                torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


def test_greedy_tokens_are_those_of_torchs_products(tmp_path, monkeypatch) -> None:
    model_dir = build_checkpoint(tmp_path, "llama")
    prompts = [list(range(10, 40)), list(range(50, 57))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("METRALE_ONEDNN", flag)
        llm = LLM(model_from_path=str(model_dir), dtype="float32")
        prepacked = all(m.onednn is not None for m in linears(llm.engine.runner.model))
        assert prepacked == (flag == "1")
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
