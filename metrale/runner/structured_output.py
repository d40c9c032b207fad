"""Grammar-constrained decoding with xgrammar: one matcher per request, a bitmask per step.

Specs compile once against the model's vocabulary (cached by spec); each request with a
`StructuredOutput` gets a matcher that masks every token the grammar cannot take next, and
accepts the token sampled. Once the grammar is complete only the stop tokens remain, so the
request ends. Requests inside a thinking block are not masked: the model thinks freely.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from metrale.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)


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
        self,
        rows: list[tuple[int, str, StructuredOutput, int | None]],
        num_rows: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, list[int]]:
        """The token bitmask of the constrained rows, and which rows those are.

        Each row is (row, request id, grammar, a token allowed besides the grammar's or None).
        """
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(num_rows, self.vocab_size)
        for row, request_id, spec, also_allowed in rows:
            matcher = self._matchers.get(request_id)
            if matcher is None:
                matcher = xgrammar.GrammarMatcher(self._compiled(spec))
                self._matchers[request_id] = matcher
            if matcher.is_terminated():  # done (ignore_eos keeps it going): no more mask
                continue
            matcher.fill_next_token_bitmask(bitmask, row)
            if also_allowed is not None:
                word, bit = divmod(also_allowed, 32)
                value = int(bitmask[row, word]) | (1 << bit)
                bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32
        return bitmask.to(device, non_blocking=True), [row for row, *_ in rows]

    def accept(self, request_id: str, token_id: int) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is not None and not matcher.accept_token(token_id):
            logger.warning(
                "request %s: token %d was not accepted by its grammar", request_id, token_id
            )

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
