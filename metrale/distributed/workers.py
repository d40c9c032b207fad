"""The tensor-parallel ranks past rank 0: one process each, started and watched by the engine core.

Rank 0 is the engine core itself: it schedules, samples and sends each step
(`step_message.py`). Each other rank is a process of its own (spawned, one per device) that joins
the group, loads its slices of the model, keeps its slice of the KV pool, and runs every step
rank 0 sends until told to stop. Startup runs in lockstep: the KV pool's size is agreed on (the
smallest any rank fits), and every forward rank 0 runs while measuring (swap and speculation
costs) the other ranks run with it, as they run the steps after.

A rank that dies takes the engine down at once: rank 0 watches the processes and, when one
exits unasked, calls its `on_death` (the engine process exits, so the API server answers 503
and turns `/health` red); a rank other than 0 whose rank 0 is gone leaves when its next
collective fails, or within a second of noticing its parent is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from metrale.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_size,
)
from metrale.distributed.setup_check import check_same_setup
from metrale.distributed.step_message import receive_step, send_stop
from metrale.engine_config import EngineConfig

logger = logging.getLogger(__name__)


def share_cpu(config: EngineConfig) -> None:
    """On a CPU, give this rank its share of the cores when several ranks or engine cores
    share the host (each would otherwise start a thread per core, and they would fight)."""
    num_ranks = config.model.tensor_parallel_size * config.data_parallel_size
    if config.device.type == "cpu" and num_ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of `rank` on its node: the GPU after the node's first rank's by the rank's
    place among the node's ranks (the first being `config.device`'s), or the CPU."""
    device = config.device
    if device.type != "cuda":
        return device
    local = rank % config.launch.ranks_per_node(config.model.tensor_parallel_size)
    return torch.device("cuda", (device.index or 0) + local)


class TensorParallelWorkers:
    """Ranks 1..N-1 as processes of this host."""

    def __init__(self, processes: list[multiprocessing.Process], device: torch.device) -> None:
        self.processes = processes
        self.device = device
        self._stopping = threading.Event()

    @classmethod
    def start(
        cls, config: EngineConfig, init_method: str, ranks: Sequence[int]
    ) -> TensorParallelWorkers:
        """Start `ranks` (of this node; never 0, the engine core's own) as processes."""
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(
                target=run_worker,
                args=(rank, init_method, config),
                name=f"metrale-tp-rank-{rank}",
                daemon=True,
            )
            for rank in ranks
        ]
        for process in processes:
            process.start()
        return cls(processes, config.device)

    def wait(self) -> int:
        """Block until every rank has exited (a node past 0 does nothing else); the first
        nonzero exit code, else 0."""
        for process in self.processes:
            process.join()
        return next((p.exitcode for p in self.processes if p.exitcode), 0)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` from a thread as soon as a rank exits unasked."""

        if not self.processes:  # every other rank is on another node
            return

        def watcher() -> None:
            sentinels = {p.sentinel: p for p in self.processes}
            ready = wait(list(sentinels))
            if self._stopping.is_set():
                return
            process = sentinels[ready[0]]
            process.join(timeout=1)
            on_death(f"tensor-parallel {process.name} exited (exit code {process.exitcode})")

        threading.Thread(target=watcher, name="metrale-tp-watch", daemon=True).start()

    def kill(self) -> None:
        """End the ranks now (a node past 0 leaving: rank 0, on another node, cannot be asked)."""
        self._stopping.set()
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the ranks to leave their loops and wait for them (killed past `timeout_s`)."""
        self._stopping.set()
        if all(p.is_alive() for p in self.processes):
            try:
                send_stop(self.device)
            except RuntimeError as e:  # a rank already gone: the collective fails
                logger.warning("tensor parallelism: could not stop the ranks in order: %s", e)
        for process in self.processes:
            process.join(timeout=timeout_s)
            if process.is_alive():
                process.kill()
                process.join()


def run_worker(rank: int, init_method: str, config: EngineConfig) -> None:
    """A rank other than 0: join, load its slices, then run rank 0's steps until told to stop."""
    from metrale.runner.model_runner import ModelRunner
    from metrale.telemetry import logs

    logs.configure()
    size = config.model.tensor_parallel_size
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = dataclasses.replace(config, device=device)
    share_cpu(config)
    init_tensor_parallel(size, rank, init_method)
    _watch_parent()
    try:
        check_same_setup(config)
        model = load_rank_model(config, progress=False)
        config = agree_on_kv_blocks(model, config)
        runner = ModelRunner(
            model,
            config.model,
            config.cache,
            config.scheduler,
            device,
            attention_backend=config.attention_backend,
            time_steps=False,
        )
        block_size, window = config.cache.block_size, config.model.sliding_window
        while (step := receive_step(device, block_size, window)) is not None:
            runner.follow(step)
    finally:
        destroy_tensor_parallel()


def load_rank_model(config: EngineConfig, progress: bool = True) -> torch.nn.Module:
    """This rank's slices of the model (the whole model at one rank)."""
    from metrale.runner.model_loader import load_model

    return load_model(
        config.model_dir,
        config.model,
        dtype=config.dtype,
        device=config.device,
        load_format=config.load_format,
        quantization=config.quantization,
        seed=config.seed,
        progress=progress,
        fused_kernels=config.attention_backend == "triton",
        keep_dense_weights=config.compile_cpu_decode,
    )


def agree_on_kv_blocks(model: torch.nn.Module, config: EngineConfig) -> EngineConfig:
    """The config with the KV pool's size set: on a GPU, what this device fits after the
    weights and the activation peak (every rank profiles the same step together), the least
    of every rank's; on a CPU, the configured size."""
    if config.cache.num_blocks is not None:
        return config
    from metrale.runner.gpu_memory import kv_blocks_for_gpu

    num_blocks = kv_blocks_for_gpu(model, config)
    if tp_size() > 1:
        least = torch.tensor([num_blocks], dtype=torch.int64, device=config.device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        num_blocks = int(least.item())
    return dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, num_blocks=num_blocks)
    )


def _watch_parent() -> None:
    """Leave within a second of rank 0's process going away (a collective in progress may
    otherwise wait for it until the group's timeout)."""
    parent = os.getppid()

    def watcher() -> None:
        while not threading.Event().wait(1.0):
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watcher, name="metrale-tp-parent", daemon=True).start()
