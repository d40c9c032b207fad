"""CUDA graphs of steps with prompt tokens: the forward captured in pieces between the attention
calls, which run eagerly in between.

A step with prompt tokens runs the same kernels as a decode step but over thousands of rows,
and its attention's launch depends on the step (how many sequences, the longest chunk), so it
cannot be one graph as a decode step is. Run eagerly, its host queues ~300 launches and ~110
products a step, each product at a row count cuBLAS has not seen (its choice of algorithm,
~0.2 ms, is paid again): on an H100 a step of 8,192 prompt tokens took 38 ms of host time for
20 ms of kernels. vLLM's answer is ours: capture everything between two attention calls (the
norms, the products, the activation, the residual adds) as one graph per piece, for a few
padded token counts, and replay them around the attention calls, which still launch eagerly
from the step's own metadata.

The pieces are cut by the model itself: it runs once per token count under capture with a
metadata object whose `attend` ends the piece being captured and begins the next, handing the
layer a fresh output buffer from the graphs' memory pool. Each attention call is recorded with
the tensors it reads and writes (non-owning views, so the pool may reuse their memory in the
pieces after, as it would in an eager forward: pieces and calls replay in capture order, on one
stream). Rows past the step's tokens are padding: their slot is -1 (nothing stored) and no
sequence covers them, so attention leaves them alone; every other operation works row by row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from metrale.engine.step import ScheduledChunk
from metrale.layers.attention import Attention, Rotary
from metrale.runner.cuda_graphs import capture_largest_first, padded_size

if TYPE_CHECKING:
    # (not imported at run time: the kernels are decorated as Triton's interpreter is set when
    # they are first imported, which the CPU tests of the kernels do after collection)
    from metrale.layers.attention.triton_backend import TritonAttentionMetadata
    from metrale.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def graph_token_counts(max_tokens: int) -> list[int]:
    """The padded token counts captured: powers of two up to 1,024, 1,536, then every 1,024,
    and `max_tokens` itself (past 1,024 tokens padding is under a third of a step's rows)."""
    counts = [n for n in (64, 128, 256, 512, 1024, 1536) if n < max_tokens]
    counts += range(2048, max_tokens, 1024)
    return sorted({*counts, max_tokens}) if max_tokens > 0 else []


def alias(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s memory that does not keep it allocated (what vLLM's weak references and
    torch's CUDA graph trees hold of a graph's tensors)."""
    storage = t.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        borrowed, t.storage_offset(), t.shape, t.stride()
    )


@dataclass(frozen=True)
class AttentionCall:
    """One layer's attention between two pieces: it reads q, k and v where the piece before
    left them and writes `out`, where the piece after reads it."""

    layer: Attention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rope: Rotary
    out: torch.Tensor

    def run(self, meta: TritonAttentionMetadata) -> None:
        meta.attend(self.layer, self.q, self.k, self.v, self.rope, out=self.out)


@dataclass
class PiecewiseGraph:
    num_tokens: int
    pieces: list[torch.cuda.CUDAGraph]  # one more than `calls`
    calls: list[AttentionCall]
    hidden: torch.Tensor  # [num_tokens, hidden_size], the final norm's output

    def replay(self, meta: TritonAttentionMetadata) -> torch.Tensor:
        """The forward over the step the buffers hold; `meta` is its attention's."""
        for piece, call in zip(self.pieces, self.calls, strict=False):
            piece.replay()
            call.run(meta)
        self.pieces[-1].replay()
        return self.hidden


class _Cutter:
    """The metadata the model is captured with: each attention call ends the piece being
    captured and begins the next (`pool` None: a warm-up pass, nothing captured)."""

    def __init__(self, pool: tuple[int, int] | None) -> None:
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[AttentionCall] = []
        self._piece: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        if self.pool is not None:
            self._piece = torch.cuda.CUDAGraph()
            self._piece.capture_begin(pool=self.pool)

    def end(self) -> None:
        if self._piece is not None:
            self._piece.capture_end()
            self.pieces.append(self._piece)
            self._piece = None

    def attend(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rotary
    ) -> torch.Tensor:
        out = torch.empty_like(q)  # inside the piece: the pool's memory
        self.end()
        self.calls.append(AttentionCall(layer, alias(q), alias(k), alias(v), rope, alias(out)))
        self.begin()
        return out


class PiecewiseGraphs:
    def __init__(self, runner: ModelRunner, max_tokens: int, pool: tuple[int, int]) -> None:
        self.runner = runner
        self.sizes = graph_token_counts(max_tokens)
        self.graphs: dict[int, PiecewiseGraph] = {}
        self.pool = pool

    def graph_for(self, chunks: list[ScheduledChunk]) -> PiecewiseGraph | None:
        """The graph that runs this step, if it has prompt tokens (a chunk past a decode) and
        no more tokens than the largest graph."""
        num_tokens = 0
        prompt = False
        for c in chunks:
            num_tokens += c.num_tokens
            prompt = prompt or not c.is_decode
        size = padded_size(self.sizes, num_tokens) if prompt else None
        return None if size is None else self.graphs[size]

    @torch.inference_mode()
    def capture(self) -> None:
        self.graphs, seconds = capture_largest_first(self.sizes, self._capture)
        logger.info(
            "captured CUDA graphs of steps with prompt tokens (%d token counts up to %d, %d "
            "pieces each) in %.1f s",
            len(self.sizes),
            self.sizes[-1] if self.sizes else 0,
            len(next(iter(self.graphs.values())).pieces) if self.graphs else 0,
            seconds,
        )

    def _capture(self, num_tokens: int) -> PiecewiseGraph:
        model, buffers = self.runner.model, self.runner.buffers
        input_ids = buffers.input_ids.device[:num_tokens]
        positions = buffers.positions.device[:num_tokens]
        input_ids.zero_()  # the warm-up reads them: token 0 at position 0
        positions.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Once uncaptured: kernels compile, cuBLAS picks its algorithms for this row count.
            model(input_ids, positions, _Cutter(None))
            torch.cuda.empty_cache()  # its activations: the pool takes as much again
            cutter = _Cutter(self.pool)
            cutter.begin()
            hidden = model(input_ids, positions, cutter)
            cutter.end()
        torch.cuda.current_stream().wait_stream(side)
        return PiecewiseGraph(num_tokens, cutter.pieces, cutter.calls, alias(hidden))
