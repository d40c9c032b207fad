"""The pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`: the split regexes behind each name
(llama.cpp keeps them in its source, src/llama-vocab.cpp, not in the file), for
`gguf_tokenizer.py` to rebuild a GGUF file's byte-level BPE tokenizer."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before a byte-level BPE merges it, for one tokenizer.ggml.pre.

    Where llama.cpp rewrote a regex for its own engine, we use the original it quotes (the one in
    the model's tokenizer.json), which the `tokenizers` library runs as written.
    """

    splits: tuple[str, ...]
    # A word that is already one token is not merged (llama.cpp's ignore_merges: Llama 3, Tekken).
    ignore_merges: bool = False
    # llama.cpp's add_bos for a file that has no tokenizer.ggml.add_bos_token.
    add_bos_token: bool = False


# GPT-2's split as the `tokenizers` ByteLevel pre-tokenizer writes it. llama.cpp's lacks the final
# `|\s+`; the only text its version leaves unmatched is what that alternative matches (a lone
# whitespace character other than " " before a non-space), and isolation keeps that as one piece.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEEPSEEK_CJK = "[一-龥ࠀ-一가-퟿]+"
# The letters of DeepSeek LLM's split, as hexadecimal code point ranges: written as characters,
# some would be changed by tools that normalize text (U+212A KELVIN SIGN into "K").
_DEEPSEEK_LETTERS = (
    "41-5A 61-7A B5 C0-D6 D8-F6 F8-1BA 1BC-1BF 1C4-293 295-2AF 370-373 376-377 37B-37D 37F 386 "
    "388-38A 38C 38E-3A1 3A3-3F5 3F7-481 48A-52F 531-556 10A0-10C5 13A0-13F5 13F8-13FD "
    "1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D "
    "1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 "
    "1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128 "
    "212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183-2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE "
    "2CF2-2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 "
    "FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 "
    "118A0-118DF 1E900-1E943"
)


def _char_class(hex_ranges: str) -> str:
    """A regex character class of "41-5A B5 ..." (code points in hexadecimal)."""
    members = []
    for hex_range in hex_ranges.split():
        first, _, last = hex_range.partition("-")
        members.append(chr(int(first, 16)) + (f"-{chr(int(last, 16))}" if last else ""))
    return "[" + "".join(members) + "]"


_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?" + _char_class(_DEEPSEEK_LETTERS) + "+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# tokenizer.ggml.pre -> its pre-tokenizer, for every name llama.cpp gives one of these (it also
# knows names whose split needs code of its own, or that serve embedding models: not here).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {}


def _register(names: Sequence[str], pre_tokenizer: PreTokenizer) -> None:
    for name in names:
        PRE_TOKENIZERS[name] = pre_tokenizer


_register(
    ["default"],
    PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
)
_register(
    [
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
        "lfm2", "jina-v5-nano",
    ],
    PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos_token=True),
)  # fmt: skip
_register(["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], PreTokenizer((_LLAMA3,)))
_register(["tekken"], PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos_token=True))
_register(
    [
        "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
        "solar-open", "grok-2",
    ],
    PreTokenizer((_QWEN2,)),
)  # fmt: skip
_register(["qwen35"], PreTokenizer((_QWEN35,)))
_register(["seed-coder"], PreTokenizer((_SEED_CODER,)))
_register(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], PreTokenizer((_GPT4O,)))
_register(
    [
        "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
        "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4", "trillion",
        "granite-docling",
    ],
    PreTokenizer((_GPT2,)),
)  # fmt: skip
# Each digit on its own, then GPT-2's split.
_register(
    ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
    PreTokenizer((r"\p{N}", _GPT2)),
)
_register(["falcon"], PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")))
_register(["deepseek-llm"], PreTokenizer(_DEEPSEEK_LLM))
_register(["deepseek-coder"], PreTokenizer(_DEEPSEEK_CODER))
_register(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], PreTokenizer(_DEEPSEEK_V3))
_register(["bloom", "poro-chat", "gpt3-finnish"], PreTokenizer((_BLOOM,)))
_register(["viking"], PreTokenizer((_BLOOM, r"\p{N}")))


def pre_tokenizer_named(pre: str | None) -> PreTokenizer:
    if pre is None:
        logger.warning(
            "GGUF file names no tokenizer.ggml.pre; using llama.cpp's 'default' split, as it "
            "does: tokenization may not match the model's (re-convert the file to fix it)"
        )
        return PRE_TOKENIZERS["default"]
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not a pre-tokenizer metrale knows: it knows "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[pre]
