"""The bytes behind a ByteLevel tokenizer's tokens.

A ByteLevel decoder (GPT-2, Llama 3, Qwen, Mistral's Tekken) writes each token as characters that
stand for bytes (GPT-2's byte-to-character map: printable bytes as themselves, the others shifted
past U+0100) and decodes some ids as the lossy UTF-8 decode of their tokens' bytes one after
another; a character outside the map (an added token's) stands for its own UTF-8 bytes. So the
text of a stream of ids is an incremental UTF-8 decode of these bytes, which
`IncrementalDetokenizer` runs instead of decoding windows of ids.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import tokenizers

_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_BYTE_OF_CHAR = {chr(byte): byte for byte in _PRINTABLE} | {
    chr(0x100 + i): byte for i, byte in enumerate(b for b in range(256) if b not in _PRINTABLE)
}


def _token_bytes(token: str) -> bytes:
    out = bytearray()
    for char in token:
        byte = _BYTE_OF_CHAR.get(char)
        if byte is None:
            out += char.encode("utf-8")
        else:
            out.append(byte)
    return bytes(out)


class TokenBytes:
    """Each token's bytes, worked out the first time it is asked for."""

    def __init__(self, backend: tokenizers.Tokenizer, special_ids: Collection[int]) -> None:
        self._backend = backend
        self._special_ids = frozenset(special_ids)
        self._bytes: dict[int, bytes] = {}

    def of(self, token_ids: Iterable[int], skip_special_tokens: bool) -> bytes:
        """The bytes of `token_ids` one after another; an id outside the vocabulary has none,
        as `decode` drops it."""
        known = self._bytes
        parts = []
        for token_id in token_ids:
            if skip_special_tokens and token_id in self._special_ids:
                continue
            data = known.get(token_id)
            if data is None:
                token = self._backend.id_to_token(token_id)
                data = known[token_id] = b"" if token is None else _token_bytes(token)
            parts.append(data)
        return b"".join(parts)
