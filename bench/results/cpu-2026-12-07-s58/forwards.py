"""What `output_rows_chunk.py` and `output_rows_engine.py` share: the engine alone over
peer_cpu.py's requests (stop 57's `requests16.py`) and its model's two forwards, the one
after 987d439 (the last layer on `rows` only) and the one before (every row through the
last layer, the sampled rows picked after)."""

import sys

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main/bench/results/cpu-2026-12-07-s57")
from requests16 import chunked_engine, token_prompts


def engine_and_forwards():
    """(prompts, llm, model, {"every row": before, "rows": after})."""
    prompts = token_prompts()
    llm = chunked_engine()
    model = llm.engine.runner.model
    kept_rows = model.forward

    def every_row(input_ids, positions, meta, rows=None):
        hidden = kept_rows(input_ids, positions, meta)
        return hidden if rows is None else hidden[rows]

    return prompts, llm, model, {"every row": every_row, "rows": kept_rows}
