"""Tokenizer against transformers' AutoTokenizer on the demo tokenizer and variants of it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import tokenizers
from tokenizers import processors

import metrale.tokenizer
from metrale.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

DEMO_DIR = Path(metrale.tokenizer.__file__).resolve().parent.parent / "demo" / "tokenizer"

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "def add(a: int, b: int) -> int:\n    return a + b",
    "Numbers: 1234567890 and 3.14159",
    "Le café est très bon; Schöne Grüße aus München.",
    "你好，世界！我们今天去公园散步。",
    "こんにちは、世界！ 안녕하세요",
    "Emoji 😀🤖🚀 with skin tone 👋🏽 and family 👨‍👩‍👧",
    "e\u0301 combining accent (NFC makes it é)",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|endoftext|>',
    "not special: <|im_star|> <thinking>",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer, hf_tokenizer, add_special_tokens):
    for text in TEXTS:
        expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer, hf_tokenizer, skip_special_tokens):
    id_lists = [tokenizer.encode(text) for text in TEXTS]
    id_lists.append(list(range(0, tokenizer.vocab_size, 37)))
    for token_ids in id_lists:
        expected = hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens) == expected


def test_vocab_and_special_tokens_match_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer) == 4096
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id is None
    assert set(hf_tokenizer.all_special_ids) <= set(tokenizer.all_special_ids)
    assert tokenizer.all_special_ids == (0, 1, 2)
    sample_ids = tokenizer.encode(TEXTS[9])
    assert tokenizer.convert_ids_to_tokens(sample_ids) == hf_tokenizer.convert_ids_to_tokens(
        sample_ids
    )


def test_reasoning_and_tool_tags_survive_skip_special_tokens(tokenizer):
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    token_ids = tokenizer.encode(text)
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tokenizer.token_to_id(tag) in token_ids
    assert (
        tokenizer.decode(token_ids)
        == "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    )
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == text


def test_token_lookup(tokenizer):
    assert tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.token_to_id("no such token") is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.convert_ids_to_tokens([tokenizer.vocab_size])


def test_missing_tokenizer_json_says_what_to_do(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*save_pretrained"):
        Tokenizer.from_dir(tmp_path)


def test_loads_without_tokenizer_config(tmp_path):
    shutil.copy(DEMO_DIR / "tokenizer.json", tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.eos_token_id is None
    assert tokenizer.encode("hi") == Tokenizer.from_dir(DEMO_DIR).encode("hi")
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def _variant(
    tmp_path: Path, config_update: dict, post_processor: object = None
) -> tuple[Tokenizer, object]:
    """The demo tokenizer with a changed config (and post-processor), loaded by both libraries."""
    backend = tokenizers.Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    if post_processor is not None:
        backend.post_processor = post_processor
    backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    config.update(config_update)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))


def _assert_same_ids(tokenizer: Tokenizer, hf_tokenizer, texts: list[str]) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer)
    for text in texts:
        for add_special_tokens in (True, False):
            expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
            assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected
        token_ids = tokenizer.encode(text)
        for skip in (True, False):
            expected_text = hf_tokenizer.decode(token_ids, skip_special_tokens=skip)
            assert tokenizer.decode(token_ids, skip_special_tokens=skip) == expected_text


def test_post_processor_decides_bos_like_transformers(tmp_path, caplog):
    add_bos = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", 0)]
    )
    # The object form of a named token, as transformers 4 saved it.
    bos_token = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    with caplog.at_level(logging.WARNING, logger="metrale.tokenizer.tokenizer"):
        tokenizer, hf_tokenizer = _variant(
            tmp_path, {"bos_token": bos_token, "add_bos_token": False}, add_bos
        )
    _assert_same_ids(tokenizer, hf_tokenizer, ["hi there", "café"])
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 0
    assert "add_bos_token=false" in caplog.text


@pytest.mark.parametrize(
    "extra",
    [
        {"additional_special_tokens": ["<think>", "<listed>"]},
        {"extra_special_tokens": ["<think>", "<listed>"]},
        {"extra_special_tokens": {"listed_token": "<listed>"}},
    ],
)
def test_config_tokens_missing_from_tokenizer_json_are_added(tmp_path, extra):
    config_update = {
        **extra,
        "bos_token": "<s>",
        "added_tokens_decoder": {
            "4096": {"content": "<extra>", "special": False, "normalized": False},
            "4097": {"content": "<ctrl>", "special": True, "normalized": False},
        },
    }
    tokenizer, hf_tokenizer = _variant(tmp_path, config_update)
    _assert_same_ids(tokenizer, hf_tokenizer, ["a<s>b", "x <extra> y <ctrl> z<think><listed>"])
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert tokenizer.decode(tokenizer.encode("a<ctrl>b<extra>")) == "ab<extra>"
