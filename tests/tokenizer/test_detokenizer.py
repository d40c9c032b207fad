"""IncrementalDetokenizer: deltas add up to the full decode, never show a broken character,
and each push decodes a bounded window."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import metrale.tokenizer
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer
from metrale.tokenizer.detokenizer import MAX_UNCLEAN_TOKENS

DEMO_DIR = Path(metrale.tokenizer.__file__).resolve().parent.parent / "demo" / "tokenizer"
REPLACEMENT_CHAR = "\ufffd"

MULTIBYTE_TEXTS = [
    "你好，世界！我们今天去公园散步。生僻字：龘靐齉爩",
    "Emoji: 😀🤖🚀 👋🏽 👨‍👩‍👧 🏳️‍🌈 and flags 🇫🇷🇯🇵",
    "Combining: e\u0301 a\u0300 o\u0308 n\u0303, Zalgo: Z\u0351\u034b\u0352a\u0357l\u0350g\u0344o",
    "Mixed: Ünïcödé, Привет, Γειά, مرحبا, नमस्ते, 한국어, 日本語 ✨",
    '<think>\n想一想 🤔\n</think>\n\n<tool_call>\n{"城市": "東京"}\n</tool_call><|im_end|>',
]


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """The demo tokenizer, ByteLevel: its streams go through the bytes path."""
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    assert tokenizer.token_bytes is not None
    return tokenizer


@pytest.fixture(scope="module")
def window_tokenizer(tmp_path_factory) -> Tokenizer:
    """The same vocabulary and text with its ByteLevel decoder inside a Sequence: not taken for
    a bytes decoder, so its streams go through the window path."""
    model_dir = tmp_path_factory.mktemp("window")
    for f in DEMO_DIR.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    spec = json.loads((DEMO_DIR / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [spec["decoder"]]}
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.token_bytes is None
    return tokenizer


@pytest.fixture(scope="module", params=["bytes", "window"])
def tokenizer(request, byte_tokenizer, window_tokenizer) -> Tokenizer:
    return byte_tokenizer if request.param == "bytes" else window_tokenizer


class DecodeSpy:
    """Wraps a Tokenizer and records how many ids each decode call gets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded_lens: list[int] = []
        self.has_byte_fallback_decoder = tokenizer.has_byte_fallback_decoder
        self.token_bytes = tokenizer.token_bytes

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lens.append(len(token_ids))
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _chunks(token_ids: list[int], rng: random.Random | None, max_burst: int) -> list[list[int]]:
    """One token at a time without ``rng``, else random bursts of 1..max_burst."""
    chunks, start = [], 0
    while start < len(token_ids):
        size = 1 if rng is None else rng.randint(1, max_burst)
        chunks.append(token_ids[start : start + size])
        start += size
    return chunks


def _stream(tokenizer, chunks: list[list[int]], skip_special_tokens: bool) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    return [detokenizer.push(chunk) for chunk in chunks] + [detokenizer.finish()]


def _assert_stream_exact(tokenizer, token_ids, chunks, skip_special_tokens) -> list[str]:
    deltas = _stream(tokenizer, chunks, skip_special_tokens)
    full = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full
    # Each delta sits at its offset in the full text, so a U+FFFD in a delta is one in `full`.
    offset = 0
    for delta in deltas:
        assert full[offset : offset + len(delta)] == delta
        offset += len(delta)
    return deltas


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_multibyte_text_never_shows_a_broken_character(tokenizer, text, skip_special_tokens):
    token_ids = tokenizer.encode(text)
    rng = random.Random(text)
    for chunks in [_chunks(token_ids, None, 1)] + [_chunks(token_ids, rng, 5) for _ in range(20)]:
        deltas = _assert_stream_exact(tokenizer, token_ids, chunks, skip_special_tokens)
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_text_streams_early(tokenizer):
    """Only an unfinished character is held back, not the text before it."""
    token_ids = tokenizer.encode("ok 🤖")
    deltas = _stream(tokenizer, _chunks(token_ids, None, 1), skip_special_tokens=True)
    assert deltas[0] == "ok"
    assert deltas[-1] == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids(tokenizer, skip_special_tokens):
    rng = random.Random(1234)
    for _ in range(300):
        token_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 80))]
        chunks = _chunks(token_ids, rng, 4)
        _assert_stream_exact(tokenizer, token_ids, chunks, skip_special_tokens)


def test_random_non_ascii_byte_tokens(tokenizer):
    """Streams made mostly of lone UTF-8 bytes: lead bytes, continuations, invalid bytes."""
    byte_token_ids = [
        token_id
        for token_id in range(tokenizer.vocab_size)
        if len(tokenizer.convert_ids_to_tokens([token_id])[0]) == 1
        and tokenizer.decode([token_id]) == REPLACEMENT_CHAR
    ]
    assert len(byte_token_ids) == 128
    ascii_id = tokenizer.encode("a")[0]
    rng = random.Random(99)
    for _ in range(300):
        token_ids = [
            rng.choice(byte_token_ids) if rng.random() < 0.9 else ascii_id
            for _ in range(rng.randint(1, 60))
        ]
        _assert_stream_exact(tokenizer, token_ids, _chunks(token_ids, rng, 3), True)


def _byte_token_id(tokenizer: Tokenizer, byte: int) -> int:
    """The id of ``byte``'s single-byte token, in GPT-2's byte-to-character mapping."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    unprintable = [other for other in range(256) if other not in printable]
    char = chr(byte) if byte in printable else chr(256 + unprintable.index(byte))
    token_id = tokenizer.token_to_id(char)
    assert token_id is not None
    return token_id


@pytest.mark.parametrize("lone_byte", [None, 0xE4, 0x80])
def test_window_stays_bounded(window_tokenizer, lone_byte):
    """A long stream, valid or one lone byte repeated, never makes a push decode a long window.

    Repeating a lead (0xE4) or continuation (0x80) byte makes every decode end in U+FFFD, so
    the window never ends clean and only the finished-boundary search bounds it.
    """
    if lone_byte is None:
        token_ids = window_tokenizer.encode("一二三四五六七八九十 🤖 " * 200)
    else:
        token_ids = [_byte_token_id(window_tokenizer, lone_byte)] * 2000
    spy = DecodeSpy(window_tokenizer)
    deltas = _assert_stream_exact(spy, token_ids, _chunks(token_ids, None, 1), True)
    assert len(spy.decoded_lens) < 6 * len(token_ids)
    # The last two calls are full decodes, by finish() and by the check.
    assert max(spy.decoded_lens[:-2]) <= 24
    # Garbage streams too: finish() gets only the last few unfinished bytes.
    assert len(deltas[-1]) <= MAX_UNCLEAN_TOKENS + 1


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory) -> Tokenizer:
    """A Llama-2-style tokenizer: Metaspace with a leading-space strip, and byte fallback."""
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    backend = BackendTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there"] * 20
    backend.train_from_iterator(corpus, trainer=trainer)
    # Byte tokens are ordinary vocabulary in Llama 2, not special added tokens.
    backend_json = json.loads(backend.to_str())
    backend_json["added_tokens"] = [
        token for token in backend_json["added_tokens"] if token["content"] not in byte_tokens
    ]
    model_dir = tmp_path_factory.mktemp("metaspace")
    (model_dir / "tokenizer.json").write_text(json.dumps(backend_json))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize(
    "text", ["hello world", " the lazy dog jumps", "hello 世界 and 😀 there ✨", *MULTIBYTE_TEXTS]
)
def test_context_dependent_decoder(metaspace_tokenizer, text):
    token_ids = metaspace_tokenizer.encode(text)
    assert metaspace_tokenizer.decode(token_ids)  # byte fallback covers every character
    rng = random.Random(text)
    for chunks in [_chunks(token_ids, None, 1)] + [_chunks(token_ids, rng, 4) for _ in range(10)]:
        deltas = _assert_stream_exact(metaspace_tokenizer, token_ids, chunks, True)
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_a_byte_level_stream_never_decodes_ids(byte_tokenizer):
    """The bytes path reads each token's bytes (once a token) and decodes UTF-8 itself: no
    `decode` of ids, whatever the stream."""
    rng = random.Random(7)
    token_ids = byte_tokenizer.encode("Plain words, 你好世界, and 🤖 emoji. " * 20)
    token_ids += [rng.randrange(byte_tokenizer.vocab_size) for _ in range(300)]
    spy = DecodeSpy(byte_tokenizer)
    _assert_stream_exact(spy, token_ids, _chunks(token_ids, rng, 3), False)
    assert spy.decoded_lens == [len(token_ids)]  # the check's own full decode


def test_added_tokens_stream_as_their_decode_writes_them(byte_tokenizer, tmp_path):
    """An added token passes through the byte map like any other (a character of the map
    stands for its byte, so "¡¿" is two invalid bytes), one outside it for its UTF-8; special
    ones are dropped when skipped."""
    for f in DEMO_DIR.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    spec = json.loads((DEMO_DIR / "tokenizer.json").read_text())
    next_id = byte_tokenizer.vocab_size + 10
    for offset, (content, special) in enumerate([("¡¿", False), ("日本", False), ("<spé>", True)]):
        spec["added_tokens"].append(
            {
                "id": next_id + offset,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
        )
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer.from_dir(tmp_path)
    added = [next_id, next_id + 1, next_id + 2]
    lead = _byte_token_id(tokenizer, 0xE6)  # the first byte of 日
    rng = random.Random(3)
    for _ in range(200):
        pool = [*added, lead, *tokenizer.encode("a 你 b")]
        token_ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            _assert_stream_exact(tokenizer, token_ids, _chunks(token_ids, rng, 3), skip)


def _spanning_token_id(tokenizer: Tokenizer) -> int:
    """A token of a continuation byte then a lead byte (e.g. B5 CE): repeated, every boundary
    between two of them falls inside a character (CE B5), so no boundary is ever finished."""
    for token_id in range(tokenizer.vocab_size):
        token = tokenizer.convert_ids_to_tokens([token_id])[0]
        three = tokenizer.decode([token_id] * 3)
        if len(token) == 2 and three.count(REPLACEMENT_CHAR) == 2 and len(three) == 4:
            return token_id
    raise AssertionError("no such token in the demo vocabulary")


def test_a_stream_without_finished_boundaries_searches_now_and_then(window_tokenizer):
    token_ids = [_spanning_token_id(window_tokenizer)] * 200
    spy = DecodeSpy(window_tokenizer)
    _assert_stream_exact(spy, token_ids, _chunks(token_ids, None, 1), True)
    # A failed search (up to two decodes a candidate) waits MAX_UNCLEAN_TOKENS tokens for the
    # next: not one search a push (which made it 15 decodes a token).
    assert len(spy.decoded_lens) < 3.5 * len(token_ids)


def test_the_bytes_path_is_exact_where_no_boundary_is_finished(byte_tokenizer):
    token_ids = [_spanning_token_id(byte_tokenizer)] * 2000
    deltas = _assert_stream_exact(byte_tokenizer, token_ids, _chunks(token_ids, None, 1), True)
    assert max(len(d) for d in deltas) <= 2  # each character as soon as its bytes are in


def test_only_a_bare_byte_level_decoder_is_taken_for_a_bytes_decoder(metaspace_tokenizer):
    assert metaspace_tokenizer.token_bytes is None
