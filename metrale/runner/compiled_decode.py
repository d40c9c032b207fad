"""Decode steps compiled by torch.compile on a CPU: the CPU's counterpart of the CUDA graphs.

A decode step of a small model on a CPU spends a third or more of its time around its products
(~1,000-1,500 aten calls a step, each a Python dispatch and an OpenMP region of its own). A step
of decodes alone runs instead as one graph that inductor compiled to C++ loops: norms, rotary,
activations and residual adds fused, and two graphs serve every step:

- one row: products as reductions that stream the dense weights (`layers/linear.streamed_product`)
  or read a GGUF file's packed blocks (`packed_gemv`), where oneDNN's one-row product reads the
  weights at ~2/3 of the machine's bandwidth (bench/profile_cpu.py), and attention as reductions
  over the paged cache in place (`layers/attention/compiled_decode.py`). ~55% of the eager step's
  time on 2 cores.
- several rows (a symbolic count, 2 or more): the packed products as eager steps run them
  (Metrale's `panel_linear` over float32 weights, else `metrale::onednn_linear`) and the C++
  paged decode attention (`kernels/cpu_extension.py`), called from the graph. 16 rows of
  peers.md's 33.6M Llama: ~12.5 against ~15 ms a step with oneDNN's products, ~10.3 with the
  panels (bench/cpu_step_ab.py).

The context (the block-table width) is a symbolic size too, so no request compiles; the pool's
and the model's sizes are constants. Both graphs are compiled at startup by warm-up steps;
inductor keeps what it compiled on disk (its FX graph cache), so a later start with the same
model and torch compiles less (the built-in model: ~80 s the first time on 2 cores, ~11 s
after). Steps with a prompt chunk or drafts stay eager. `--enforce-eager` turns this off.

Each engine compiles its own graphs, over its own copy of `_logits`' code (dynamo keeps graphs
per code object), and they skip dynamo's guards on the model's modules: ~1,400 checks a step
(that no module gained a hook, each weight's shape and strides, each attribute's value), ~0.3 ms
of a 5-10 ms step on 2 cores, against a model whose modules do not change once the engine is
built. The guards on the step's inputs stay. An engine's code holds its two graphs, well
under dynamo's limit of graphs a code object (8), which no longer needs raising for the
process as it did while every engine's graphs shared one code object.
"""

from __future__ import annotations

import logging
import time
import types
from typing import TYPE_CHECKING

import torch
import torch.fx.experimental._config as fx_config

from metrale.engine.step import ScheduledChunk
from metrale.kernels import cpu_extension
from metrale.layers.attention import StepBatch
from metrale.layers.attention.compiled_decode import CompiledDecodeMetadata
from metrale.runner.probe_steps import decode_probe

if TYPE_CHECKING:
    from metrale.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """`fn` over a copy of its code object: the graphs dynamo compiles for it are kept with the
    copy, apart from any other engine's (whose model the skipped module guards could not tell
    apart), and go when it goes."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


class CompiledDecode:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._forward = torch.compile(
            types.MethodType(_own_code(CompiledDecode._logits), self),
            dynamic=False,
            fullgraph=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )
        self._warming_up = False
        kv = runner.kv_cache.kv
        self.cpu_kernel = cpu_extension.attends_in_place(kv.dtype, kv.shape[-1])

    def _logits(
        self,
        kv: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        meta = CompiledDecodeMetadata(
            kv,
            slot_mapping,
            block_tables,
            seq_lens,
            self.runner.block_size,
            self.runner.model_config.sliding_window,
            self.cpu_kernel,
        )
        model = self.runner.model
        return model.compute_logits(model(input_ids, positions, meta))

    @staticmethod
    def handles(chunks: list[ScheduledChunk]) -> bool:
        """Whether the step is decodes alone (one token each, no drafts), each sampling."""
        return all(c.samples and c.num_tokens == 1 for c in chunks)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The logits of the step `handles` accepted, laid out as `batch` (its ids and positions
        in the runner's input buffers, as `_fill_inputs` left them)."""
        buffers = self.runner.buffers
        rows = batch.seq_lens.shape[0]
        block_tables = batch.block_tables
        if block_tables.shape[1] < 2:  # a size of one would compile another graph
            block_tables = buffers.block_tables.device[:rows, :2]
        inputs = (
            buffers.input_ids.device[:rows],
            buffers.positions.device[:rows],
            batch.slot_mapping,
            block_tables,
            batch.seq_lens,
        )
        if self._warming_up:  # the graph compiled now serves every size marked (~0.1 ms a mark)
            torch._dynamo.mark_dynamic(block_tables, 1)
            if rows > 1:
                for t in inputs:
                    torch._dynamo.mark_dynamic(t, 0)
        return self._forward(self.runner.kv_cache.kv, *inputs)

    def warm_up(self) -> bool:
        """Compile the graph by running a decode step into the pool's first blocks: call it
        before any request holds them. False (logged) where it cannot compile, e.g. on a machine
        without the C++ compiler inductor calls: the steps then stay eager."""
        logger.info(
            "compiling the decode steps (torch.compile: a minute or two on a small CPU the "
            "first time, less once cached; --enforce-eager skips it)"
        )
        start = time.perf_counter()
        runner = self.runner
        num_blocks = runner.kv_cache.kv.shape[2]
        self.runner.compiled = self  # the warm-up steps run through it
        self._warming_up = True
        # Only the sizes `run` marks are symbols (the block-table width, and the row count of
        # the graph of several rows): the pool's shape and the model's are constants, which
        # traces ~5x faster than every size symbolic. Each symbol is its own: by default the
        # tracer gives equal sizes one symbol, and a width fused with another size would make
        # every request of another width compile again (~20 s).
        try:
            with fx_config.patch(use_duck_shape=False):
                for rows in (1, 2):  # a graph for one row, and one for any number of rows
                    runner.execute(
                        decode_probe(rows, 0, 2 * runner.block_size, runner.block_size, num_blocks)
                    )
        except Exception as e:  # whatever the compiler stack raises
            logger.warning(
                "could not compile the decode steps, they stay eager: %s: %s",
                type(e).__name__,
                str(e).strip().splitlines()[0] if str(e).strip() else "",
            )
            return False
        finally:
            self.runner.compiled = None
            self._warming_up = False
        logger.info("compiled the CPU decode steps in %.1f s", time.perf_counter() - start)
        return True
