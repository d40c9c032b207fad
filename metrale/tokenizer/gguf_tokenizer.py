"""tokenizer.json and tokenizer_config.json for a GGUF file, rebuilt from its tokenizer.* metadata.

A GGUF file has no tokenizer.json: llama.cpp keeps the vocabulary, merges, scores, token types and
special ids as metadata, and only names the pre-tokenizer (``tokenizer.ggml.pre``); the split
regexes behind each name live in llama.cpp's source (src/llama-vocab.cpp). We rebuild the same
tokenizer for the `tokenizers` library, so that a GGUF checkpoint tokenizes as llama.cpp does:

- ``gpt2``, byte-level BPE: the file's merges; the regexes of the pre name, applied in order, each
  splitting what the previous left and keeping both its matches and the text between them (as
  llama.cpp's unicode_regex_split does); then the byte-to-unicode map.
- ``llama``, SentencePiece BPE: merges derived from the scores (llama.cpp merges the adjacent pair
  whose merged token scores highest), spaces written "▁", a "▁" put before the text and after
  every added token (llama.cpp's add_space_prefix), and <0xNN> tokens for bytes of unknown text.

Control tokens become special added tokens and user-defined ones plain added tokens, so that both
are matched whole in text, as llama.cpp's tokenizer_st_partition matches them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from metrale.tokenizer.gguf_pretokenizers import pre_tokenizer_named

logger = logging.getLogger(__name__)

SPIECE_UNDERLINE = "\u2581"


class TokenType(IntEnum):
    """tokenizer.ggml.token_type values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Matched whole in text before the model sees it; the special ones are dropped by
# decode(skip_special_tokens=True).
SPECIAL_TOKEN_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})
ADDED_TOKEN_TYPES = SPECIAL_TOKEN_TYPES | {TokenType.USER_DEFINED}


BYTE_LEVEL_MODEL = "gpt2"
SENTENCEPIECE_MODEL = "llama"
SUPPORTED_MODELS = (BYTE_LEVEL_MODEL, SENTENCEPIECE_MODEL)


def _is_of(value: object, kind: type | tuple[type, ...]) -> bool:
    # bool is an int to Python; a flag stored as 0/1, or an id stored as a flag, is a broken file.
    return isinstance(value, kind) and isinstance(value, bool) == (kind is bool)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _field(fields: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``fields[key]`` checked to be of ``kind``; None when the file lacks it."""
    value = fields.get(key)
    if value is not None and not _is_of(value, kind):
        raise ValueError(f"GGUF metadata {key} must be {_kind_name(kind)}, got {value!r:.80}")
    return value


def _list_field(fields: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> list | None:
    """``fields[key]`` checked to be a list of ``kind``; None when the file lacks it."""
    values = _field(fields, key, list)
    for value in values or ():
        if not _is_of(value, kind):
            raise ValueError(
                f"GGUF metadata {key} must be a list of {_kind_name(kind)}, holds {value!r:.80}"
            )
    return values


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer.* metadata of a GGUF file, checked: what both tokenizer kinds are built of."""

    model: str
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[TokenType, ...]
    scores: tuple[float, ...] | None
    merges: tuple[str, ...] | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    # None where the file does not say; llama.cpp's defaults are applied by the builders.
    add_bos_token: bool | None
    add_eos_token: bool | None
    add_space_prefix: bool | None
    # A string, or [{"name", "template"}, ...] when the file has named templates too.
    chat_template: str | list[dict[str, str]] | None
    context_len: int | None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> GGUFVocab:
        model = _field(fields, "tokenizer.ggml.model", str)
        if model is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.model: the file has no tokenizer")
        if model not in SUPPORTED_MODELS:
            raise ValueError(
                f"GGUF tokenizer.ggml.model {model!r} is not supported: metrale builds "
                f"{BYTE_LEVEL_MODEL!r} (byte-level BPE) and {SENTENCEPIECE_MODEL!r} "
                "(SentencePiece BPE) tokenizers"
            )
        tokens = _list_field(fields, "tokenizer.ggml.tokens", str)
        if not tokens:
            raise ValueError(
                "GGUF metadata has no tokenizer.ggml.tokens: the file has no vocabulary"
            )
        # llama.cpp's name for an empty token, which no dictionary could hold.
        tokens = [token or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]
        num_tokens = len(tokens)
        raw_types = _list_field(fields, "tokenizer.ggml.token_type", int)
        if raw_types is None:
            raw_types = [TokenType.NORMAL] * num_tokens
        scores = _list_field(fields, "tokenizer.ggml.scores", (float, int))
        for key, values in (("token_type", raw_types), ("scores", scores)):
            if values is not None and len(values) < num_tokens:
                raise ValueError(
                    f"GGUF metadata tokenizer.ggml.{key} has {len(values):,} entries for "
                    f"{num_tokens:,} tokens: the file is corrupt"
                )
        known_types = set(TokenType)
        token_types = tuple(
            TokenType(value) if value in known_types else TokenType.UNDEFINED
            for value in raw_types[:num_tokens]
        )
        merges = _list_field(fields, "tokenizer.ggml.merges", str)
        special_ids = {}
        for name, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"),
        ):
            token_id = _field(fields, f"tokenizer.ggml.{key}", int)
            if token_id is None and model == SENTENCEPIECE_MODEL:
                token_id = {"bos": 1, "eos": 2, "unk": 0}.get(name)  # llama.cpp's defaults
            if token_id is not None and not 0 <= token_id < num_tokens:
                logger.warning(
                    "GGUF tokenizer.ggml.%s=%d is outside the %d tokens; ignoring it",
                    key,
                    token_id,
                    num_tokens,
                )
                token_id = None
            special_ids[name] = token_id
        arch = _field(fields, "general.architecture", str)
        context_len = _field(fields, f"{arch}.context_length", int) if arch else None
        return cls(
            model=model,
            pre=_field(fields, "tokenizer.ggml.pre", str),
            tokens=tuple(tokens),
            token_types=token_types,
            scores=None if scores is None else tuple(float(s) for s in scores[:num_tokens]),
            merges=None if merges is None else tuple(merges),
            bos_token_id=special_ids["bos"],
            eos_token_id=special_ids["eos"],
            unk_token_id=special_ids["unk"],
            pad_token_id=special_ids["pad"],
            add_bos_token=_field(fields, "tokenizer.ggml.add_bos_token", bool),
            add_eos_token=_field(fields, "tokenizer.ggml.add_eos_token", bool),
            add_space_prefix=_field(fields, "tokenizer.ggml.add_space_prefix", bool),
            chat_template=_chat_template(fields),
            context_len=context_len,
        )

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]

    def token_ids(self) -> dict[str, int]:
        """Token -> id; llama.cpp refuses a vocabulary with a token twice, and so do we."""
        token_ids: dict[str, int] = {}
        for token_id, token in enumerate(self.tokens):
            first_id = token_ids.setdefault(token, token_id)
            if first_id != token_id:
                raise ValueError(
                    f"GGUF vocabulary holds {token!r} twice (ids {first_id} and {token_id}): "
                    "the file is corrupt"
                )
        return token_ids


def _chat_template(fields: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """tokenizer.chat_template, with the named ones (tokenizer.chat_template.<name>, listed in
    tokenizer.chat_templates) as the list of named templates tokenizer_config.json allows."""
    default = _field(fields, "tokenizer.chat_template", str)
    names = _list_field(fields, "tokenizer.chat_templates", str) or []
    named = [
        {"name": name, "template": template}
        for name in names
        if (template := _field(fields, f"tokenizer.chat_template.{name}", str)) is not None
    ]
    if not named:
        return default
    return ([{"name": "default", "template": default}] if default is not None else []) + named


def _split_merges(merges: Sequence[str], token_ids: Mapping[str, int]) -> list[tuple[str, str]]:
    """GGUF's "a b" merges as pairs, in rank order, each checked to join two tokens into one."""
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for rank, merge in enumerate(merges):
        # llama.cpp splits at the first space after the first character.
        space = merge.find(" ", 1)
        if space < 0:
            raise ValueError(
                f"GGUF tokenizer.ggml.merges[{rank}] is {merge!r}, not two tokens joined by a space"
            )
        pair = (merge[:space], merge[space + 1 :])
        missing = [t for t in (*pair, pair[0] + pair[1]) if t not in token_ids]
        if missing:
            raise ValueError(
                f"GGUF tokenizer.ggml.merges[{rank}] {merge!r} needs {missing[0]!r}, which is not "
                "in tokenizer.ggml.tokens: the file is corrupt"
            )
        if pair not in seen:  # llama.cpp keeps a repeated merge's first rank
            seen.add(pair)
            pairs.append(pair)
    return pairs


def _merges_from_scores(vocab: GGUFVocab, token_ids: Mapping[str, int]) -> list[tuple[str, str]]:
    """A BPE merge for every way to cut a token in two tokens, best merged score first.

    llama.cpp's SentencePiece tokenizer repeatedly merges the adjacent pair whose joined text is
    the highest-scoring token, so ranking the merges by that score does the same. Ties are broken
    as transformers' generate_merges breaks them.
    """
    assert vocab.scores is not None
    merges: list[tuple[float, str, str]] = []
    for token, score in zip(vocab.tokens, vocab.scores, strict=True):
        cuts = [
            (token[:index], token[index:])
            for index in range(1, len(token))
            if token[:index] in token_ids and token[index:] in token_ids
        ]
        cuts.sort(key=lambda cut: (token_ids[cut[0]], token_ids[cut[1]]))
        merges.extend((score, left, right) for left, right in cuts)
    merges.sort(key=lambda merge: (merge[0], len(merge[1]), len(merge[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


def _add_gguf_added_tokens(tokenizer: tokenizers.Tokenizer, vocab: GGUFVocab) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens,
    all matched in the raw text (normalized=False), at their own ids."""
    for token, token_type in zip(vocab.tokens, vocab.token_types, strict=True):
        if token_type not in ADDED_TOKEN_TYPES:
            continue
        special = token_type in SPECIAL_TOKEN_TYPES
        added = AddedToken(token, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])


def _template_post_processor(
    vocab: GGUFVocab, *, add_bos: bool, add_eos: bool
) -> dict[str, Any] | None:
    """A TemplateProcessing that frames each sequence with BOS and/or EOS; None for neither."""
    framing: dict[str, int] = {}
    for wanted, token_id, kind in (
        (add_bos, vocab.bos_token_id, "bos"),
        (add_eos, vocab.eos_token_id, "eos"),
    ):
        if not wanted:
            continue
        if token_id is None:
            raise ValueError(
                f"GGUF tokenizer add_{kind}_token is true but the file has no valid {kind} token "
                f"id (tokenizer.ggml.{kind}_token_id): the file is corrupt"
            )
        framing[kind] = token_id
    if not framing:
        return None

    def sequence(name: str, type_id: int) -> list[dict[str, Any]]:
        def special(kind: str) -> list[dict[str, Any]]:
            if kind not in framing:
                return []
            return [{"SpecialToken": {"id": vocab.tokens[framing[kind]], "type_id": type_id}}]

        return [*special("bos"), {"Sequence": {"id": name, "type_id": type_id}}, *special("eos")]

    return {
        "type": "TemplateProcessing",
        "single": sequence("A", 0),
        "pair": sequence("A", 0) + sequence("B", 1),
        "special_tokens": {
            vocab.tokens[token_id]: {
                "id": vocab.tokens[token_id],
                "ids": [token_id],
                "tokens": [vocab.tokens[token_id]],
            }
            for token_id in framing.values()
        },
    }


def _byte_level_tokenizer(vocab: GGUFVocab) -> tuple[dict[str, Any], bool]:
    """tokenizer.json for a "gpt2" vocabulary, and whether it adds BOS."""
    pre = pre_tokenizer_named(vocab.pre)
    if vocab.merges is None:
        raise ValueError("GGUF tokenizer.ggml.model is 'gpt2' but the file has no merges")
    token_ids = vocab.token_ids()
    model = models.BPE(
        vocab=token_ids,
        merges=_split_merges(vocab.merges, token_ids),
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre.ignore_merges,
    )
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(tokenizer, vocab)
    add_bos = pre.add_bos_token if vocab.add_bos_token is None else vocab.add_bos_token
    add_eos = bool(vocab.add_eos_token)
    serialized = json.loads(tokenizer.to_str())
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    template = _template_post_processor(vocab, add_bos=add_bos, add_eos=add_eos)
    serialized["post_processor"] = (
        byte_level
        if template is None
        else {"type": "Sequence", "processors": [byte_level, template]}
    )
    return serialized, add_bos


def _sentencepiece_tokenizer(vocab: GGUFVocab) -> tuple[dict[str, Any], bool]:
    """tokenizer.json for a "llama" vocabulary, and whether it adds BOS."""
    if vocab.scores is None:
        raise ValueError(
            "GGUF tokenizer.ggml.model is 'llama' but the file has no tokenizer.ggml.scores, "
            "which its merges are derived from"
        )
    token_ids = vocab.token_ids()
    model = models.BPE(
        vocab=token_ids,
        merges=_merges_from_scores(vocab, token_ids),
        unk_token=vocab.token(vocab.unk_token_id),
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = tokenizers.Tokenizer(model)
    add_space_prefix = True if vocab.add_space_prefix is None else vocab.add_space_prefix
    escape_spaces = normalizers.Replace(" ", SPIECE_UNDERLINE)
    # The normalizer runs on each stretch of text between added tokens, so the prefix also lands
    # after each of them, as in llama.cpp (transformers>=5 puts it before the first stretch only).
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPIECE_UNDERLINE), escape_spaces])
        if add_space_prefix
        else escape_spaces
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    _add_gguf_added_tokens(tokenizer, vocab)
    add_bos = True if vocab.add_bos_token is None else vocab.add_bos_token
    serialized = json.loads(tokenizer.to_str())
    serialized["post_processor"] = _template_post_processor(
        vocab, add_bos=add_bos, add_eos=bool(vocab.add_eos_token)
    )
    return serialized, add_bos


def gguf_tokenizer_files(fields: Mapping[str, Any]) -> dict[str, dict]:
    """{"tokenizer.json": {...}, "tokenizer_config.json": {...}} built from a GGUF file's
    tokenizer.* metadata (already decoded to Python values: str, int, float, bool, lists).

    ``fields`` may hold the file's other metadata too: ``<general.architecture>.context_length``
    becomes model_max_length. A tokenizer that cannot be built as llama.cpp builds it (another
    tokenizer.ggml.model, an unknown tokenizer.ggml.pre, a corrupt vocabulary) is a ValueError.
    """
    vocab = GGUFVocab.from_fields(fields)
    if vocab.model == BYTE_LEVEL_MODEL:
        tokenizer_json, add_bos = _byte_level_tokenizer(vocab)
    else:
        tokenizer_json, add_bos = _sentencepiece_tokenizer(vocab)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, token_id in (
        ("bos_token", vocab.bos_token_id),
        ("eos_token", vocab.eos_token_id),
        ("unk_token", vocab.unk_token_id),
        ("pad_token", vocab.pad_token_id),
    ):
        if token_id is not None:
            config[name] = vocab.tokens[token_id]
    config["add_bos_token"] = add_bos
    config["add_eos_token"] = bool(vocab.add_eos_token)
    # metrale decodes with tokenizers alone; this only keeps transformers from altering spaces.
    config["clean_up_tokenization_spaces"] = False
    if vocab.context_len is not None:
        config["model_max_length"] = vocab.context_len
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config}
