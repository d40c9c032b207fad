"""Grammar-constrained decoding with xgrammar: one matcher per request, a bitmask per step.

Specs compile once against the model's vocabulary (cached by spec); each request with a
`StructuredOutput` gets a matcher that masks every token the grammar cannot take next, and
accepts the tokens sampled; a speculative draft is masked as the grammar would have it after the
drafts before it (see `bitmask`). Once the grammar is complete only the stop tokens remain, so
the request ends. Requests inside a thinking block are not masked: the model thinks freely.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from metrale.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)


class GrammarRows(NamedTuple):
    """A constrained chunk's rows of a step: its first, then one per draft."""

    row: int
    request_id: str
    spec: StructuredOutput
    also_allowed: int | None  # a token allowed besides the grammar's at the first row
    drafts: tuple[int, ...] = ()


class StructuredOutputs:
    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._matchers: dict[str, object] = {}

    @functools.cached_property
    def _compiler(self):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        return xgrammar.GrammarCompiler(info)

    @functools.lru_cache(maxsize=256)  # noqa: B019  (one instance per engine, specs are few)
    def _compiled(self, spec: StructuredOutput):
        import xgrammar

        if spec.kind == "json":
            body = (
                xgrammar.Grammar.from_json_schema(spec.spec, any_whitespace=False)
                if spec.spec
                else xgrammar.Grammar.builtin_json_grammar()
            )
        elif spec.kind == "regex":
            body = xgrammar.Grammar.from_regex(spec.spec)
        else:
            body = xgrammar.Grammar.from_ebnf(spec.spec)
        grammar = body
        if spec.max_leading_newlines:
            newlines = " ".join(['"\\n"?'] * spec.max_leading_newlines)
            grammar = xgrammar.Grammar.concat(
                xgrammar.Grammar.from_ebnf(f"root ::= {newlines}"), body
            )
        return self._compiler.compile_grammar(grammar)

    def validate(self, spec: StructuredOutput) -> None:
        """Compile now, so a bad schema or regex is the request's error, not the engine's."""
        try:
            self._compiled(spec)
        except Exception as e:  # xgrammar raises several kinds for bad specs
            raise ValueError(f"structured output: cannot compile the {spec.kind} ({e})") from e

    def bitmask(
        self, rows: list[GrammarRows], num_rows: int, device: torch.device
    ) -> tuple[torch.Tensor, list[int]]:
        """The token bitmask of the constrained rows, and which rows those are.

        A chunk with drafts has a row per draft after its first: each row's mask is the
        grammar's after the drafts before it, so a draft the grammar rejects can never be
        sampled in its place and is rejected (as are the drafts after it, whose rows stay
        unmasked: nothing reads them). The matcher is rolled back to where the step began.
        """
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(num_rows, self.vocab_size)
        masked = []
        for chunk in rows:
            matcher = self._matchers.get(chunk.request_id)
            if matcher is None:
                matcher = xgrammar.GrammarMatcher(self._compiled(chunk.spec))
                self._matchers[chunk.request_id] = matcher
            if matcher.is_terminated():  # done (ignore_eos keeps it going): no more mask
                continue
            matcher.fill_next_token_bitmask(bitmask, chunk.row)
            masked.append(chunk.row)
            if chunk.also_allowed is not None:
                word, bit = divmod(chunk.also_allowed, 32)
                value = int(bitmask[chunk.row, word]) | (1 << bit)
                bitmask[chunk.row, word] = value - (1 << 32) if value >= 1 << 31 else value
            num_accepted = 0
            for draft in chunk.drafts:
                if not matcher.accept_token(draft):
                    break
                num_accepted += 1
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, chunk.row + num_accepted)
                masked.append(chunk.row + num_accepted)
            if num_accepted:
                matcher.rollback(num_accepted)
        return bitmask.to(device, non_blocking=True), masked

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        """The step's tokens of the request, its accepted drafts first."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        for token_id in token_ids:
            if matcher.is_terminated():  # its stop token taken (ignore_eos goes on unmasked)
                return
            if not matcher.accept_token(token_id):
                logger.warning(
                    "request %s: token %d was not accepted by its grammar", request_id, token_id
                )
                return

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
