"""Streaming token ids to text, one request at a time."""

from __future__ import annotations

import codecs
from collections.abc import Collection, Sequence

from metrale.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Unread tokens that never decoded clean: past this many (a UTF-8 character spans at most 4
# tokens) they hold invalid bytes, and push looks for a finished boundary to restart the
# window at, so that garbage output cannot grow the window without bound.
MAX_UNCLEAN_TOKENS = 8
# How far back from the newest token that search goes.
BOUNDARY_SEARCH_TOKENS = 8


def _trailing_replacement_len(text: str) -> int:
    return len(text) - len(text.rstrip(REPLACEMENT_CHAR))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Invariants, with ``full = tokenizer.decode(all pushed ids)``:
      * the deltas of push, then finish, concatenate to ``full``;
      * a delta never holds a U+FFFD that ``full`` lacks at the same place: a trailing run of
        U+FFFD may be an incomplete character that later tokens complete, so it is held back.
    Each push decodes a window of recent tokens only. The window starts at a token where the
    text decoded clean (did not end in U+FFFD), so its first tokens are emitted context that
    keeps context-dependent decoders (Metaspace's leading space, WordPiece joins) exact.
    A stream of invalid bytes never decodes clean; the window then restarts at a finished
    boundary, keeping each push O(window) with a bounded window. ByteFallback decoders
    (Llama 2, Mistral) are the exception: they decode a run of byte tokens all-or-nothing, so
    no boundary inside an unfinished run can be proven finished, and their window grows for
    as long as the model emits invalid bytes. That same all-or-nothing rule can also turn text
    already emitted into U+FFFD once a later byte makes the run invalid, breaking the first
    invariant; finish() then returns the rest of the full decode after the emitted length.

    A search for a finished boundary that finds none waits MAX_UNCLEAN_TOKENS tokens for the next.

    Where the tokenizer's text is the lossy UTF-8 decode of its tokens' bytes (ByteLevel:
    `Tokenizer.token_bytes`), none of this is needed: the tokens' bytes go through an incremental
    UTF-8 decoder, which holds back only a character still incomplete and replaces invalid bytes
    as the full decode does (the maximal invalid subparts, one U+FFFD each), so the deltas are
    exactly the full decode's text, at constant cost a token, whatever the model writes.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        kept_special_ids: Collection[int] = (),
    ) -> None:
        """``kept_special_ids``: special tokens that stay in the text even when the others are
        skipped. They are kept by dropping the others before decoding, which is what skipping
        does: the full decode is then that of the ids less the skipped ones."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens and not kept_special_ids
        self._dropped_ids: frozenset[int] = frozenset()
        if skip_special_tokens and kept_special_ids:
            self._dropped_ids = frozenset(tokenizer.all_special_ids) - frozenset(kept_special_ids)
        # The bytes path (ByteLevel tokenizers): their tokens' bytes and a UTF-8 decoder.
        self._token_bytes = tokenizer.token_bytes
        self._utf8 = None
        if self._token_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._token_ids: list[int] = []
        self._num_emitted_chars = 0
        # The window is token_ids[window_start:]; read_start is where its unemitted part began
        # when the window was last restarted. emitted_len counts window text already emitted.
        self._window_start = 0
        self._read_start = 0
        self._emitted_len = 0
        self._next_search = MAX_UNCLEAN_TOKENS  # a boundary search once past this many tokens

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they made final (possibly empty)."""
        if self._dropped_ids:
            new_token_ids = [i for i in new_token_ids if i not in self._dropped_ids]
        if self._utf8 is not None:
            data = self._token_bytes.of(new_token_ids, self._skip_special_tokens)
            return self._utf8.decode(data)
        self._token_ids.extend(new_token_ids)
        text = self._decode(self._window_start)
        stable_len = len(text) - _trailing_replacement_len(text)
        delta = self._emit(text, stable_len)
        if stable_len == len(text):
            self._restart_window(len(self._token_ids))
        elif (
            len(self._token_ids) > self._next_search
            and not self._tokenizer.has_byte_fallback_decoder
        ):
            delta += self._restart_at_finished_boundary(text)
        return delta

    def finish(self) -> str:
        """Return the text held back so far; the stream is complete."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        full = self._tokenizer.decode(
            self._token_ids, skip_special_tokens=self._skip_special_tokens
        )
        rest = full[self._num_emitted_chars :]
        self._num_emitted_chars = len(full)
        return rest

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _emit(self, window_text: str, end: int) -> str:
        if end <= self._emitted_len:
            return ""
        delta = window_text[self._emitted_len : end]
        self._emitted_len = end
        self._num_emitted_chars += len(delta)
        return delta

    def _restart_window(self, read_start: int) -> None:
        """Start the window at the previous read start, all text up to ``read_start`` emitted.

        Holds when the text decoded clean at ``read_start``: the kept tokens are context only.
        """
        self._window_start, self._read_start = self._read_start, read_start
        self._emitted_len = len(self._decode(self._window_start, read_start))
        self._next_search = read_start + MAX_UNCLEAN_TOKENS

    def _restart_at_finished_boundary(self, window_text: str) -> str:
        """Bound the window when invalid bytes keep it from decoding clean; emit what is final.

        A boundary is finished when decoding the window in two parts there equals decoding it
        whole: no character spans it, and no later token can make one span it. The text before
        it, replacement characters included, is then what the full decode has there.
        """
        end = len(self._token_ids)
        for boundary in range(end - 1, max(self._read_start, end - BOUNDARY_SEARCH_TOKENS), -1):
            head = self._decode(self._window_start, boundary)
            if head + self._decode(boundary) != window_text:
                continue
            delta = self._emit(window_text, len(head))
            # The window text is head + the new window's text, so positions shift by len(head).
            self._window_start = self._read_start = boundary
            self._emitted_len -= len(head)
            self._next_search = boundary + MAX_UNCLEAN_TOKENS
            return delta
        self._next_search = end + MAX_UNCLEAN_TOKENS
        return ""
