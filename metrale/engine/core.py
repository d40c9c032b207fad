"""The engine core: the loop that schedules, runs the model and updates, and nothing else.

It knows nothing of text or HTTP: requests come in as token ids with validated sampling
parameters, and each `step()` returns the new tokens of every request that advanced.

With async scheduling a step is launched before the previous one's tokens are back, so the host
schedules and prepares step N+1 while the device runs step N, and `step()` returns step N's
tokens. A request that needs its last token on the host before its next step (a grammar, a
thinking budget about to run out) makes the engine collect the step in flight before it
schedules the next one; the penalties read a history kept on the device and never do.
"""

from __future__ import annotations

import _thread
import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from metrale.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from metrale.distributed.setup_check import check_same_setup
from metrale.distributed.workers import (
    TensorParallelWorkers,
    agree_on_kv_blocks,
    load_rank_model,
    share_cpu,
)
from metrale.engine.block_pool import BlockPool
from metrale.engine.kv_cache_manager import KVCacheManager
from metrale.engine.messages import EngineOutput, EngineRequest, StepStats
from metrale.engine.request import Request
from metrale.engine.scheduler import Scheduler
from metrale.engine.speculation.cost_model import VerifyCosts
from metrale.engine.speculation.shared_lookup import SharedLookup, model_fingerprints
from metrale.engine.speculation.speculator import NgramSpeculator
from metrale.engine.step import ModelRunnerOutput, SchedulerOutput
from metrale.engine.swap_space import SwapCosts, SwapSpace
from metrale.engine_config import EngineConfig
from metrale.runner.model_runner import LaunchedStep, ModelRunner
from metrale.runner.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)

# Tokens of the prefill timed at startup for the swap-or-recompute choice (CPU, GPU): near the
# chunk a recompute runs in, short enough not to slow the start.
PREFILL_PROBE_TOKENS = (128, 2048)


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self._in_flight: deque[tuple[SchedulerOutput, LaunchedStep]] = deque()
        # Each step's figures, until the engine loop ships them (bounded for callers that never
        # take them, like the offline LLM).
        self.step_stats: deque[StepStats] = deque(maxlen=4096)
        self.workers: TensorParallelWorkers | None = None  # ranks 1..N-1 (tensor parallelism)

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        progress: bool = True,
        on_rank_death: Callable[[str], None] | None = None,
    ) -> EngineCore:
        """Build the engine: with tensor parallelism, start the other ranks first (they load
        their slices while this process loads its own); once the engine is built, a rank that
        dies calls `on_rank_death(reason)` (default: interrupt the main thread)."""
        share_cpu(config)
        if config.device.index is not None:  # its own GPU (a data-parallel core's, rank 0's)
            torch.cuda.set_device(config.device)
        workers = start_ranks(config)
        try:
            core = cls._build(config, progress)
        except BaseException:
            if workers is not None:
                workers.kill()
                destroy_tensor_parallel()
            raise
        if workers is not None:
            workers.watch(on_rank_death or _interrupt_main)
        core.workers = workers
        return core

    @classmethod
    def _build(cls, config: EngineConfig, progress: bool) -> EngineCore:
        start = time.perf_counter()
        model = load_rank_model(config, progress)
        loaded = time.perf_counter()
        config = agree_on_kv_blocks(model, config)
        sized = time.perf_counter()
        runner = ModelRunner(
            model,
            config.model,
            config.cache,
            config.scheduler,
            config.device,
            attention_backend=config.attention_backend,
            max_cuda_graph_batch=config.max_cuda_graph_batch,
            max_cuda_graph_tokens=config.max_cuda_graph_tokens,
            time_steps=config.log_stats,
            num_speculative_tokens=(
                0 if config.speculative is None else config.speculative.num_speculative_tokens
            ),
            compile_decode=config.compile_cpu_decode,
            structured_outputs=StructuredOutputs(
                config.model_dir, config.model.vocab_size, config.eos_token_ids
            ),
        )
        pool = BlockPool(config.cache.num_blocks, config.cache.enable_prefix_caching)
        scheduler = Scheduler(
            config.scheduler,
            KVCacheManager(pool, config.cache.block_size),
            swap=swap_space(config, runner),
            speculator=None if config.speculative is None else speculator(config, runner),
        )
        logger.info(
            "engine ready in %.2f s (weights %.2f s, KV sizing %.2f s, runner %.2f s): %s on %s "
            "(%s), %d KV blocks of %d tokens (%s), %s scheduling",
            time.perf_counter() - start,
            loaded - start,
            sized - loaded,
            time.perf_counter() - sized,
            config.model.architecture,
            config.device,
            str(config.dtype).removeprefix("torch."),
            config.cache.num_blocks,
            config.cache.block_size,
            str(config.cache.dtype).removeprefix("torch."),
            "async" if config.async_scheduling else "sync",
        )
        return cls(config, runner, scheduler)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any, and leave their group."""
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
            destroy_tensor_parallel()

    def add_request(self, request: EngineRequest) -> None:
        self.validate(request)
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_ids=self.config.eos_token_ids,
                arrival_time_s=request.arrival_time_s,
                priority=request.priority,
                deadline_s=request.deadline_s,
                tenant=request.tenant,
            )
        )

    def validate(self, request: EngineRequest) -> None:
        """Refuse what the engine cannot run, before it touches any engine state."""
        validate_request(self.config, request)
        if (structured := request.sampling_params.structured) is not None:
            self.runner.sampling.structured_outputs.validate(structured)
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")

    def abort_request(self, request_id: str) -> EngineOutput | None:
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished_requests > 0 or bool(self._in_flight)

    def step(self) -> list[EngineOutput]:
        """Launch the next step; return the tokens of the one before it (async) or of it."""
        start = time.perf_counter()
        outputs: list[EngineOutput] = self.scheduler.expire()
        if self._in_flight and self.scheduler.needs_pending_tokens():
            collected = [self._collect(outputs)]
        else:
            scheduled = self.scheduler.schedule()
            self._in_flight.append((scheduled, self.runner.launch(scheduled)))
            keep = 1 if self.config.async_scheduling and not scheduled.is_empty else 0
            collected = []
            while len(self._in_flight) > keep:
                collected.append(self._collect(outputs))
        if self.config.log_stats:
            self._record_stats(time.perf_counter() - start, collected)
        return outputs

    def _collect(self, outputs: list[EngineOutput]) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        scheduled, launched = self._in_flight.popleft()
        result = self.runner.collect(launched)
        if result.swap_s is not None and self.scheduler.swap is not None:
            self.scheduler.swap.copy_s += result.swap_s
        outputs.extend(self.scheduler.update(scheduled, result))
        return scheduled, result

    def _record_stats(
        self, wall_s: float, collected: list[tuple[SchedulerOutput, ModelRunnerOutput]]
    ) -> None:
        """One `StepStats` per step collected by this call (the device's steps); the host time
        of the call goes to the last of them. Preemptions made while scheduling are kept for the
        next step collected if this call collected none."""
        host_s = wall_s - sum(result.wait_s for _, result in collected)
        collected = [(s, r) for s, r in collected if not s.is_empty or s.swap_out]
        if not collected:
            return
        preempted, self.scheduler.preempted_ids = self.scheduler.preempted_ids, []
        closed, self.scheduler.num_thinking_loops_closed = (
            self.scheduler.num_thinking_loops_closed,
            0,
        )
        for i, (scheduled, result) in enumerate(collected):
            last = i == len(collected) - 1
            self.step_stats.append(
                StepStats(
                    num_tokens=scheduled.num_tokens,
                    num_requests=len(scheduled.chunks),
                    host_s=host_s if last else None,
                    device_s=result.device_s,
                    cuda_graph=result.cuda_graph,
                    preempted=preempted if last else [],
                    thinking_loops_closed=closed if last else 0,
                    swapped_out_blocks=len(scheduled.swap_out),
                    swapped_in_blocks=len(scheduled.swap_in),
                    swap_s=result.swap_s,
                )
            )


def start_ranks(config: EngineConfig) -> TensorParallelWorkers | None:
    """With tensor parallelism: this node's other ranks started, and this process joined to
    them as rank 0, having checked they run the same checkpoint and flags; else None."""
    if (size := config.model.tensor_parallel_size) == 1:
        return None
    init_method = config.launch.init_method(config.data_parallel_rank)
    ranks = [r for r in config.launch.local_ranks(size) if r != 0]
    workers = TensorParallelWorkers.start(config, init_method, ranks)
    logger.info(
        "tensor parallelism: %d ranks (%d on this node), %s", size, 1 + len(ranks), init_method
    )
    try:
        init_tensor_parallel(size, 0, init_method)
        check_same_setup(config)
    except BaseException:
        workers.kill()
        destroy_tensor_parallel()
        raise
    return workers


def _interrupt_main(reason: str) -> None:
    logger.error("%s: the engine cannot go on", reason)
    _thread.interrupt_main()


def speculator(config: EngineConfig, runner: ModelRunner) -> NgramSpeculator:
    """The n-gram speculator of `--speculative-config`, with its shared table if asked and the
    costs of verifying drafts on this machine."""
    spec = config.speculative
    assert spec is not None
    shared = None
    if spec.shared_lookup:
        fingerprints = model_fingerprints(config.model_name, config.model_dir)
        shared = SharedLookup(
            spec.ngram_max, spec.num_speculative_tokens, spec.shared_lookup_entries, fingerprints
        )
        logger.info(
            "shared n-gram lookup: up to %d entries, model %s, tokenizer %s",
            spec.shared_lookup_entries,
            *fingerprints,
        )
    costs = None
    if spec.cost_model:
        costs = VerifyCosts.measure(
            spec.num_speculative_tokens,
            min(
                config.scheduler.max_batch_size,
                config.scheduler.max_num_batched_tokens // (1 + spec.num_speculative_tokens),
            ),
            runner.measure_decode_s,
        )
        logger.info("speculation: drafts pay when accepted per draft token at %s", costs.describe())
    return NgramSpeculator(spec, shared, config.async_scheduling, costs)


def swap_space(config: EngineConfig, runner: ModelRunner) -> SwapSpace | None:
    """The host pool of `--swap-space-gb`, with this machine's copy and prefill costs."""
    if not config.cache.num_host_blocks:
        return None
    probe_tokens = PREFILL_PROBE_TOKENS[config.device.type == "cuda"]
    costs = SwapCosts(
        copy_bytes_per_s=runner.kv_cache.measure_copy_bandwidth(),
        prefill_s_per_token=runner.measure_prefill_s_per_token(
            min(probe_tokens, config.scheduler.max_prefill_tokens, config.scheduler.max_seq_len)
        ),
    )
    swap = SwapSpace(
        config.cache.num_host_blocks,
        runner.kv_cache.bytes_per_block,
        costs,
        config.scheduler.preemption_mode,
    )
    logger.info(
        "swap space: %d host blocks (%.2f GiB); copies %.2f GB/s, prefill %.1f us/token; "
        "preemption mode %s",
        swap.num_blocks,
        swap.num_blocks * swap.bytes_per_block / 2**30,
        costs.copy_bytes_per_s / 1e9,
        costs.prefill_s_per_token * 1e6,
        swap.mode,
    )
    return swap


def validate_request(config: EngineConfig, request: EngineRequest) -> None:
    """The checks any process holding the config can make (the API server makes them first)."""
    num_tokens = len(request.prompt_token_ids)
    max_seq_len = config.scheduler.max_seq_len
    vocab_size = config.model.vocab_size
    if num_tokens == 0:
        raise ValueError("prompt is empty: give at least one token")
    if num_tokens > max_seq_len:
        raise ValueError(
            f"prompt has {num_tokens} tokens; max_seq_len is {max_seq_len}: shorten the "
            f"prompt or raise --max-seq-len"
        )
    if not all(0 <= t < vocab_size for t in request.prompt_token_ids):
        bad = next(t for t in request.prompt_token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is out of range: ids must be in [0, {vocab_size})")
    params = request.sampling_params
    for name, token_ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", list(params.logit_bias or ())),
    ):
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"{name} token ids must be in [0, {vocab_size})")
    max_len = min(num_tokens + (params.max_tokens or max_seq_len), max_seq_len)
    block_size = config.cache.block_size
    if -(-max_len // block_size) > config.cache.num_blocks:
        raise ValueError(
            f"a request of up to {max_len} tokens needs {-(-max_len // block_size)} KV "
            f"blocks but the pool has {config.cache.num_blocks}: lower max_tokens or "
            f"raise --kv-cache-memory"
        )
