"""Run one scheduled step: flat inputs in, one sampled token per finishing chunk out.

The step's requests are laid end to end with no padding between them (`input_ids`,
`positions`, `slot_mapping`), the model runs once over all of them, logits are computed only at
each sampling chunk's last token, and the sampler picks on the device, from the inputs
`SamplingInputs` (`sampling_inputs.py`) builds of the chunks. `launch()` queues all of it and
returns at once; `collect()` waits for the device once, where the sampled ids come back.
In between the host may launch the next step: its decodes read their pending input tokens from
this step's samples, on the device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from metrale.config import CacheConfig, ModelConfig, SchedulerConfig
from metrale.distributed.parallel_state import tp_rank, tp_size
from metrale.distributed.step_message import StepInputs, send_step
from metrale.engine.messages import TokenLogprobs
from metrale.engine.step import (
    PENDING_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
)
from metrale.kernels import cpu_extension
from metrale.layers.attention import AttentionMetadata, StepBatch, metadata_builder
from metrale.runner.compiled_decode import CompiledDecode
from metrale.runner.cuda_graphs import DecodeGraph, DecodeGraphs
from metrale.runner.input_buffers import InputBuffers, to_device
from metrale.runner.kv_cache import PagedKVCache, SwapTiming
from metrale.runner.piecewise_graphs import PiecewiseGraphs
from metrale.runner.probe_steps import decode_probe, prefill_probe
from metrale.runner.sampler import SamplerOutput, sample
from metrale.runner.sampling_inputs import SamplingInputs
from metrale.runner.structured_output import StructuredOutputs


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device; its samples reach the host once `copied` has fired. Its
    timing fields are set in place as the step is launched (no copy per step)."""

    chunks: list[ScheduledChunk]  # the sampling chunks, one per row of `samples`
    samples: SamplerOutput | None  # host tensors, written by non-blocking copies
    copied: torch.cuda.Event | None  # None on CPU, where everything is already done
    # Recorded before the step's first kernel: with `copied`, the device's time for the step.
    started: torch.cuda.Event | None = None
    device_s: float | None = None  # on CPU, the wall time of the forward and sampling
    cuda_graph: bool = False
    swap: SwapTiming | None = None  # the block copies queued before it, if any


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        attention_backend: str = "torch",
        max_cuda_graph_batch: int = 0,
        max_cuda_graph_tokens: int = 0,
        structured_outputs: StructuredOutputs | None = None,
        time_steps: bool = True,
        num_speculative_tokens: int = 0,
        compile_decode: bool = False,
    ) -> None:
        self.model = model
        # Each step's device time (two timing events on a GPU, a clock on a CPU), for the
        # engine's statistics; off with `--disable-log-stats`.
        self.time_steps = time_steps
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = device
        self.kv_cache = PagedKVCache(model, model_config, cache_config, device)
        max_blocks_per_seq = -(-scheduler_config.max_seq_len // self.block_size)
        max_tokens = scheduler_config.max_num_batched_tokens
        # Attention sequences a step may lay out: a decode with drafts is one per row.
        max_seqs = scheduler_config.max_batch_size * (1 + num_speculative_tokens)
        self.buffers = InputBuffers(
            max_tokens,
            max(scheduler_config.max_batch_size, min(max_seqs, max_tokens)),
            max_blocks_per_seq,
            device,
        )
        self.sampling = SamplingInputs(
            self.buffers,
            model_config.vocab_size,
            scheduler_config.max_seq_len,
            device,
            structured_outputs,
        )
        self._num_samples = 0
        self.num_graph_replays = 0
        self.num_piecewise_replays = 0
        self.num_compiled_steps = 0
        # The latest step's sampled ids, on the device, and its sampling chunks (one per row):
        # the next step's pending input tokens.
        self._last_samples = torch.zeros(0, dtype=torch.int64, device=device)
        self._last_sampling_chunks: list[ScheduledChunk] = []
        # Fired when a step's host-to-device copies are done and its pinned buffers free again.
        self._inputs_copied = torch.cuda.Event() if device.type == "cuda" else None
        self.build_metadata = metadata_builder(attention_backend)
        if device.type == "cpu" and attention_backend == "torch":
            cpu_extension.enabled()  # built now (once a machine), not in a request's step
        # Rank 0 of several tensor-parallel ranks: it sends each step to the others.
        self.leads_ranks = tp_size() > 1 and tp_rank() == 0
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if max_cuda_graph_batch > 0:
            self.graphs = DecodeGraphs(
                self, min(max_cuda_graph_batch, scheduler_config.max_batch_size)
            )
            self.graphs.capture()
        if max_cuda_graph_tokens > 0 and attention_backend == "triton":
            pool = self.graphs.pool if self.graphs is not None else None
            self.piecewise = PiecewiseGraphs(
                self, min(max_cuda_graph_tokens, max_tokens), pool or torch.cuda.graph_pool_handle()
            )
            self.piecewise.capture()
        # On a CPU: decode steps compiled by torch.compile (the model keeps dense weights).
        self.compiled: CompiledDecode | None = None
        if compile_decode:
            compiled = CompiledDecode(self)
            if compiled.warm_up():
                self.compiled = compiled

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (keys, values) slices of the pool."""
        return self.kv_cache.layers

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(scheduled))

    @torch.inference_mode()
    def launch(self, scheduled: SchedulerOutput) -> LaunchedStep:
        """Queue the step (after its swaps) on the device and return without waiting for it."""
        swap = self._swap(scheduled)
        if not self.time_steps:
            step = self._launch(scheduled)
        elif self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
            step = self._launch(scheduled)
            step.started = started
        else:
            start = time.perf_counter()
            step = self._launch(scheduled)
            step.device_s = time.perf_counter() - start
        step.swap = swap
        return step

    def measure_prefill_s_per_token(self, num_tokens: int) -> float:
        """Seconds per token of a `num_tokens` prefill, timed once warm, into the pool's first
        blocks: call it before any request holds them."""
        num_tokens = min(num_tokens, self.kv_cache.kv.shape[2] * self.block_size)
        step = prefill_probe(num_tokens, self.block_size)
        self.execute(step)
        start = time.perf_counter()
        self.execute(step)
        return (time.perf_counter() - start) / num_tokens

    def measure_decode_s(self, num_seqs: int, num_drafts: int, context_len: int = 256) -> float:
        """Seconds of a decode step of `num_seqs` sequences of `context_len` tokens, each with
        `num_drafts` drafts checked (greedy), timed once warm (the best of two) into the pool's
        first blocks: call it before any request holds them."""
        step = decode_probe(
            num_seqs, num_drafts, context_len, self.block_size, self.kv_cache.kv.shape[2]
        )
        self.execute(step)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            self.execute(step)
            times.append(time.perf_counter() - start)
        return min(times)

    def _swap(self, scheduled: SchedulerOutput) -> SwapTiming | None:
        """Queue the step's block copies to and from the host pool, timed."""
        if not scheduled.swap_out and not scheduled.swap_in:
            return None
        timing = SwapTiming.start(self.device)
        if scheduled.swap_out:
            self.kv_cache.swap_out(scheduled.swap_out)
        if scheduled.swap_in:
            self.kv_cache.swap_in(scheduled.swap_in)
        timing.stop()
        return timing

    def _launch(self, scheduled: SchedulerOutput) -> LaunchedStep:
        for request_id in scheduled.finished_request_ids:
            self.sampling.drop(request_id)
        chunks = scheduled.chunks
        sampling_chunks = [c for c in chunks if c.samples]
        if not chunks:
            if self.leads_ranks and (scheduled.swap_out or scheduled.swap_in):
                empty = self.buffers.input_ids.device[:0]
                send_step(empty, empty, None, empty, scheduled.swap_out, scheduled.swap_in)
            return LaunchedStep([], None, None)
        graph = self.graphs.graph_for(chunks) if self.graphs is not None else None
        forward = self._filled_forward(chunks, scheduled, graph)
        # The sampler's inputs are copied before the forward is queued, so the event fires as
        # soon as the device starts the step: with async scheduling the next step fills the
        # buffers while this one runs, not after its forward, which idled the device for the
        # host's whole fill (on an H100, 0.3 ms a step at one row, 0.9 ms at 256).
        sampler_inputs = None
        if sampling_chunks:
            sampler_inputs = self.sampling.prepare(sampling_chunks, scheduled.has_drafts)
        self._record_inputs_copied()
        logits = forward()
        if sampler_inputs is None:
            return LaunchedStep([], None, None)
        metadata, first_rows = sampler_inputs
        result = sample(logits.float(), metadata)
        self.sampling.record(metadata, result.token_ids)
        self._last_samples = result.token_ids
        if first_rows is not None:  # each chunk's own row: the first of its rows
            self._last_samples = result.token_ids[
                to_device(first_rows[:-1], torch.int64, self.device)
            ]
        self._last_sampling_chunks = sampling_chunks
        step = self._copy_to_host(result, sampling_chunks)
        step.cuda_graph = graph is not None
        return step

    def _filled_forward(
        self, chunks: list[ScheduledChunk], scheduled: SchedulerOutput, graph: DecodeGraph | None
    ) -> Callable[[], torch.Tensor | None]:
        """Fill the step's inputs and copy them to the device; return the call that queues its
        forward and gives the logits of its sampled rows (None where no row samples)."""
        if graph is not None:
            self._fill_inputs(chunks, padded_num_seqs=graph.num_seqs)
            self.num_graph_replays += 1
            return lambda: graph.replay()[: self._num_samples]  # a row per token: all sample
        if self.compiled is not None and self.compiled.handles(chunks):
            batch = self._fill_inputs(chunks)
            self.num_compiled_steps += 1
            return lambda: self.compiled.run(batch)
        piecewise = self.piecewise.graph_for(chunks) if self.piecewise is not None else None
        padded = 0 if piecewise is None else piecewise.num_tokens
        input_ids, positions, meta, logits_indices = self._prepare_inputs(chunks, scheduled, padded)
        self.num_piecewise_replays += piecewise is not None

        def forward() -> torch.Tensor | None:
            if piecewise is not None:  # the graphs' shapes are fixed: every row, then the kept
                hidden = piecewise.replay(meta)[logits_indices]
            else:
                hidden = self.model(input_ids, positions, meta, _rows(logits_indices, input_ids))
            return self.model.compute_logits(hidden) if len(logits_indices) else None

        return forward

    def _record_inputs_copied(self) -> None:
        if self._inputs_copied is not None:
            self._inputs_copied.record()

    def _fill_inputs(
        self, chunks: list[ScheduledChunk], padded_num_seqs: int = 0, padded_num_tokens: int = 0
    ) -> StepBatch:
        """Lay the chunks end to end in the input buffers; copy them to the device.

        Attention sees sequences of query rows: a chunk is one, except a decode with drafts,
        whose rows become one-row sequences of the same blocks, each seeing the context up to
        its own position (a causal verify through the decode path, as a CUDA graph of one-row
        sequences replays it). With `padded_num_seqs` (a CUDA-graph batch of one-row sequences),
        sequences past the real ones are padding: they store nothing and attend to one token of
        block 0. With `padded_num_tokens` (a piecewise graph's token count), rows past the real
        tokens are padding in no sequence: token 0 at position 0, stored nowhere. A pending
        token is taken from the previous step's samples once the ids are on the device.
        """
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()  # the previous step's copies have read the buffers
        b = self.buffers
        bs = self.block_size
        num_tokens = 0
        seq = 0  # attention sequences laid out so far
        max_blocks = 0
        max_query_len = 0
        num_decode_seqs = 0
        num_samples = 0
        num_pending = 0
        b.query_start_loc.np[0] = 0
        for chunk in chunks:
            n = chunk.num_tokens
            end = num_tokens + n
            start = chunk.start_pos
            block_ids = chunk.block_ids
            if chunk.token_ids[-1] == PENDING_TOKEN_ID:
                b.pending_dst.np[num_pending] = end - 1
                if num_pending == 0:  # only async steps have any: index the last step once
                    rows = {c.request_id: row for row, c in enumerate(self._last_sampling_chunks)}
                b.pending_src.np[num_pending] = rows[chunk.request_id]
                num_pending += 1
            if n == 1:  # decode: scalar writes, no temporary arrays (most rows of big batches)
                if num_decode_seqs == seq:  # the leading run of one-row sequences goes on
                    num_decode_seqs += 1
                b.block_tables.np[seq, : len(block_ids)] = block_ids
                b.input_ids.np[num_tokens] = chunk.token_ids[0]
                b.positions.np[num_tokens] = start
                b.slot_mapping.np[num_tokens] = block_ids[start // bs] * bs + start % bs
                b.start_positions.np[seq] = start
                b.seq_lens.np[seq] = start + 1
                b.query_start_loc.np[seq + 1] = end
                seq += 1
            else:
                pos = np.arange(start, start + n)
                b.input_ids.np[num_tokens:end] = chunk.token_ids
                b.positions.np[num_tokens:end] = pos
                b.block_tables.np[seq, : len(block_ids)] = block_ids
                b.slot_mapping.np[num_tokens:end] = (
                    b.block_tables.np[seq, pos // bs] * bs + pos % bs
                )
                if chunk.is_decode:  # with drafts: n one-row sequences
                    if num_decode_seqs == seq:
                        num_decode_seqs += n
                    b.block_tables.np[seq + 1 : seq + n, : len(block_ids)] = block_ids
                    b.start_positions.np[seq : seq + n] = pos
                    b.seq_lens.np[seq : seq + n] = pos + 1
                    b.query_start_loc.np[seq + 1 : seq + n + 1] = np.arange(num_tokens, end) + 1
                    seq += n
                else:
                    b.start_positions.np[seq] = start
                    b.seq_lens.np[seq] = start + n
                    b.query_start_loc.np[seq + 1] = end
                    seq += 1
                    max_query_len = max(max_query_len, n)
            if chunk.draft_token_ids:  # the logits at its last token and at each draft
                num_rows = 1 + len(chunk.draft_token_ids)
                b.logits_indices.np[num_samples : num_samples + num_rows] = np.arange(
                    end - num_rows, end
                )
                num_samples += num_rows
            elif chunk.samples:
                b.logits_indices.np[num_samples] = end - 1
                num_samples += 1
            num_tokens = end
            max_blocks = max(max_blocks, len(block_ids))
        self._num_samples = num_samples
        num_seqs = seq
        max_query_len = max(max_query_len, min(num_seqs, 1))  # one-row sequences only: 1
        if padded_num_seqs:
            pad = slice(num_seqs, padded_num_seqs)
            b.input_ids.np[pad] = 0
            b.positions.np[pad] = 0
            b.slot_mapping.np[pad] = -1
            b.block_tables.np[pad] = 0
            b.seq_lens.np[pad] = 1
            b.query_start_loc.np[num_seqs + 1 : padded_num_seqs + 1] = np.arange(
                num_seqs + 1, padded_num_seqs + 1
            )
            num_tokens = num_seqs = num_decode_seqs = padded_num_seqs
            max_blocks = b.block_tables.np.shape[1]
            max_query_len = 1
        if padded_num_tokens:
            pad = slice(num_tokens, padded_num_tokens)
            b.input_ids.np[pad] = 0
            b.positions.np[pad] = 0
            b.slot_mapping.np[pad] = -1
            num_tokens = padded_num_tokens
        input_ids = b.input_ids.copy_to_device(num_tokens)
        if num_pending:
            dst = b.pending_dst.copy_to_device(num_pending)
            input_ids[dst] = self._last_samples[b.pending_src.copy_to_device(num_pending)]
        b.positions.copy_to_device(num_tokens)
        return StepBatch(
            slot_mapping=b.slot_mapping.copy_to_device(num_tokens),
            block_tables=b.block_tables.copy_to_device(num_seqs)[:, :max_blocks],
            seq_lens=b.seq_lens.copy_to_device(num_seqs),
            query_start_loc=b.query_start_loc.copy_to_device(num_seqs + 1),
            query_start_loc_host=b.query_start_loc.np[: num_seqs + 1],
            start_positions_host=b.start_positions.np[:num_seqs],
            max_query_len=max_query_len,
            num_decode_seqs=num_decode_seqs,
            block_size=bs,
            sliding_window=self.model_config.sliding_window,
        )

    def _prepare_inputs(
        self,
        chunks: list[ScheduledChunk],
        scheduled: SchedulerOutput | None = None,
        padded_num_tokens: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        batch = self._fill_inputs(chunks, padded_num_tokens=padded_num_tokens)
        num_tokens = batch.slot_mapping.shape[0]
        b = self.buffers
        input_ids = b.input_ids.device[:num_tokens]
        positions = b.positions.device[:num_tokens]
        logits_indices = b.logits_indices.copy_to_device(self._num_samples)
        if self.leads_ranks:  # the other ranks run the same batch (with the step's copies)
            swap_out, swap_in = (scheduled.swap_out, scheduled.swap_in) if scheduled else ([], [])
            send_step(input_ids, positions, batch, logits_indices, swap_out, swap_in)
        return input_ids, positions, self.build_metadata(batch), logits_indices

    @torch.inference_mode()
    def follow(self, step: StepInputs) -> None:
        """A rank other than 0: run rank 0's step (`send_step`) over this rank's slices: its
        block copies, the forward, and the logits (whose collective gathers them to rank 0)."""
        if step.swap_out:
            self.kv_cache.swap_out(step.swap_out)
        if step.swap_in:
            self.kv_cache.swap_in(step.swap_in)
        if step.batch is None:
            return
        rows = _rows(step.logits_indices, step.input_ids)
        hidden = self.model(step.input_ids, step.positions, self.build_metadata(step.batch), rows)
        if step.logits_indices.numel():
            self.model.compute_logits(hidden)

    def _copy_to_host(self, result: SamplerOutput, chunks: list[ScheduledChunk]) -> LaunchedStep:
        if self.device.type != "cuda":
            return LaunchedStep(chunks, result, None)

        def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)  # into pinned memory

        host = SamplerOutput(
            *(to_host(getattr(result, f.name)) for f in dataclasses.fields(result))
        )
        copied = torch.cuda.Event(enable_timing=self.time_steps)
        copied.record()
        return LaunchedStep(chunks, host, copied)

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's samples (the step's one sync with the device)."""
        swap_s = None if step.swap is None else step.swap.seconds()
        if step.samples is None:
            return ModelRunnerOutput([], [], device_s=step.device_s, swap_s=swap_s)
        device_s, wait_s = step.device_s, 0.0
        # (a GPU step that samples nothing has no end event: its device time goes unmeasured)
        if step.copied is not None:
            start = time.perf_counter()
            step.copied.synchronize()
            wait_s = time.perf_counter() - start
            if step.started is not None:
                device_s = step.started.elapsed_time(step.copied) / 1e3
        timing = {
            "device_s": device_s,
            "wait_s": wait_s,
            "cuda_graph": step.cuda_graph,
            "swap_s": swap_s,
        }
        result, chunks = step.samples, step.chunks
        token_ids, accepted, rows = verify(chunks, result.token_ids.tolist())
        timing["accepted_draft_ids"] = accepted
        structured_outputs = self.sampling.structured_outputs
        for i, (chunk, token_id) in enumerate(zip(chunks, token_ids, strict=True)):
            if chunk.structured is None or structured_outputs is None:
                continue
            if token_id != chunk.thinking_opener:  # a thinking block opened: the grammar waits
                kept = [] if accepted is None else accepted[i]
                structured_outputs.accept(chunk.request_id, [*kept, token_id])
        if result.logprobs is None:
            return ModelRunnerOutput(token_ids, [None] * len(token_ids), **timing)
        chosen = result.logprobs.tolist()
        ranks = result.ranks.tolist()
        top_ids = result.top_ids.tolist()
        top_logprobs = result.top_logprobs.tolist()

        def at(row: int, token_id: int, n: int) -> TokenLogprobs:
            top = list(zip(top_ids[row][:n], top_logprobs[row][:n], strict=True))
            return TokenLogprobs(token_id, chosen[row], ranks[row], top)

        logprobs: list[TokenLogprobs | None] = []
        drafts_logprobs: list[list[TokenLogprobs]] = []
        for i, (row, chunk, token_id) in enumerate(zip(rows, chunks, token_ids, strict=True)):
            n = chunk.sampling_params.logprobs
            kept = [] if accepted is None else accepted[i]
            # An accepted draft was sampled at its own row, the rows before the chunk's token's.
            drafts_logprobs.append(
                [at(row - len(kept) + j, t, n) for j, t in enumerate(kept)] if n is not None else []
            )
            logprobs.append(None if n is None else at(row, token_id, n))
        if accepted is not None:
            timing["accepted_draft_logprobs"] = drafts_logprobs
        return ModelRunnerOutput(token_ids, logprobs, **timing)


def verify(
    chunks: list[ScheduledChunk], row_token_ids: list[int]
) -> tuple[list[int], list[list[int]] | None, list[int]]:
    """Each sampling chunk's token, the drafts it accepted before it (None: no chunk drafted)
    and the row it was sampled at, from the tokens sampled at every row (a chunk with drafts has
    a row per draft position after its own). A draft is accepted while it equals the token
    sampled in its place; the token sampled after the last accepted one is the chunk's."""
    if len(row_token_ids) == len(chunks):
        return row_token_ids, None, list(range(len(chunks)))
    token_ids, accepted, rows = [], [], []
    row = 0
    for chunk in chunks:
        drafts = chunk.draft_token_ids
        num_accepted = 0
        while (
            num_accepted < len(drafts) and drafts[num_accepted] == row_token_ids[row + num_accepted]
        ):
            num_accepted += 1
        accepted.append(list(drafts[:num_accepted]))
        token_ids.append(row_token_ids[row + num_accepted])
        rows.append(row + num_accepted)
        row += 1 + len(drafts)
    return token_ids, accepted, rows


def _rows(logits_indices: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The rows whose hidden states the step needs (the model's `rows`): None where every row
    samples (decode steps), so the model gathers nothing."""
    return None if len(logits_indices) == len(input_ids) else logits_indices
