"""The grammar's masks for a step's rows, with xgrammar on the demo tokenizer: a chunk's drafts
each get the mask the grammar has after the drafts before them, up to the first the grammar
rejects, and the matcher ends the step where it began."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from metrale.runner.structured_output import GrammarRows, StructuredOutputs
from metrale.sampling_params import StructuredOutput
from tests.conftest import demo_tokenizer_dir

SPEC = StructuredOutput("regex", "(ab)+c")


def allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    word, bit = divmod(token_id, 32)
    return bool((int(bitmask[row, word]) >> bit) & 1)


def test_each_draft_row_is_masked_as_the_grammar_stands_after_the_drafts_before_it():
    tokenizer = Tokenizer.from_file(str(demo_tokenizer_dir() / "tokenizer.json"))
    a, b, c = (tokenizer.token_to_id(ch) for ch in "abc")
    outputs = StructuredOutputs(demo_tokenizer_dir(), tokenizer.get_vocab_size(), (0,))
    # Row 3 is another chunk's; the constrained chunk's rows are 0-2 (its first, two drafts),
    # and its second draft (b after "ab") is one the grammar rejects.
    rows = [GrammarRows(0, "r", SPEC, None, (a, b)), GrammarRows(4, "s", SPEC, None, (a, b, b))]
    bitmask, masked = outputs.bitmask(rows, 8, torch.device("cpu"))
    assert masked == [0, 1, 2, 4, 5, 6]
    expected = {
        0: {a},  # the start
        1: {b},  # after a
        2: {a, c},  # after ab
    }
    for first in (0, 4):
        for offset, tokens in expected.items():
            for token_id in (a, b, c):
                assert allowed(bitmask, first + offset, token_id) == (token_id in tokens)
    # Past the rejected draft nothing is masked (nothing reads the row), nor are other rows.
    assert all(allowed(bitmask, 7, t) for t in (a, b, c))
    assert all(allowed(bitmask, 3, t) for t in (a, b, c))
    # The matchers stand where the step began: the step's kept tokens are accepted from there.
    outputs.accept("s", [a, b])
    again, _ = outputs.bitmask([GrammarRows(0, "s", SPEC, None)], 1, torch.device("cpu"))
    assert [allowed(again, 0, t) for t in (a, b, c)] == [True, False, True]
