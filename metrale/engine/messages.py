"""Every message between the API process and the engine-core process, in one module.

Messages are `msgspec.Struct`s, msgpack-encoded and framed as [kind, payload] ZMQ multipart
messages; the kind tells the receiver which type to decode the payload into. The engine uses
these same types internally, so nothing is converted on either side.
"""

from __future__ import annotations

import enum

import msgspec

from metrale.engine.swap_space import SwapStats
from metrale.sampling_params import SamplingParams


class MessageKind(bytes, enum.Enum):
    # API -> engine
    ADD = b"add"
    ABORT = b"abort"
    SHUTDOWN = b"shutdown"
    # engine -> API
    READY = b"ready"
    OUTPUTS = b"outputs"
    FAILED = b"failed"


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS or stop token
    LENGTH = "length"  # max_tokens or max_seq_len reached
    ABORT = "abort"  # the client went away or asked to cancel


class EngineRequest(msgspec.Struct, frozen=True):
    """A request as the engine core receives it: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float
    priority: int = 0  # lower first, under --scheduler priority
    deadline_s: float | None = None  # time.monotonic() past which the engine aborts it
    tenant: str | None = None  # the API key's client: whose text its drafts may come from


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one output position: the sampled token's, and the top N."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]


class RequestTiming(msgspec.Struct, frozen=True, array_like=True):
    """When the engine saw a request's milestones (`time.monotonic()`, which every process on
    the machine shares); None for one it never reached."""

    queued_s: float  # added to the engine's queue
    scheduled_s: float | None  # first scheduled
    first_token_s: float | None  # (the API process times the tokens after it itself)


class EngineOutput(msgspec.Struct, frozen=True, array_like=True):
    """What one step produced for one request: new tokens, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    timing: RequestTiming | None = None  # on a request's first output, and on an abort's
    stop_reason: str | None = None  # a watchdog's name when one ended it (engine/watchdog.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class DeviceMemory(msgspec.Struct, frozen=True):
    """The engine's device memory: the whole device's reading, what the engine's allocator
    holds, and the budget `--gpu-memory-utilization` gives the engine (None on a CPU)."""

    device: str
    total_bytes: int | None = None
    used_bytes: int | None = None  # by every process on the device
    allocated_bytes: int | None = None  # by this engine's tensors
    budget_bytes: int | None = None


class SpecDecodeStats(msgspec.Struct, frozen=True):
    """Speculative decoding's counts since start, as vLLM's `spec_decode_*` metrics count them."""

    num_drafts: int  # steps of a request that carried drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]  # [i]: drafts accepted at position i


class KVCacheStats(msgspec.Struct, frozen=True):
    """The KV pool as the engine last saw it; read by `/memory`."""

    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    block_size: int
    bytes_per_block: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    memory: DeviceMemory | None = None
    num_recomputed_tokens: int = 0  # computed, dropped by a preemption, computed again
    swap: SwapStats | None = None  # the host pool, with --swap-space-gb
    spec_decode: SpecDecodeStats | None = None  # with --speculative-config

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


class StepStats(msgspec.Struct, frozen=True, array_like=True):
    """One engine step's figures, for the metrics. `host_s` is the step's wall time less the
    time it waited for the device; `device_s` the device's time for the forward and sampling
    (CUDA events; on a CPU the forward's wall time, which is also host time)."""

    num_tokens: int  # tokens the step computed
    num_requests: int
    host_s: float | None  # None: counted with another step of the same call
    device_s: float | None  # None: not measured (a GPU step that samples nothing)
    cuda_graph: bool  # run as one CUDA graph replay
    preempted: list[str]  # requests preempted while scheduling it
    thinking_loops_closed: int = 0  # thinking blocks the watchdog closed since the last stats
    swapped_out_blocks: int = 0  # KV blocks copied to the host pool before the step
    swapped_in_blocks: int = 0  # and back
    swap_s: float | None = None  # the device's time for those copies


class CPUThreads(msgspec.Struct, frozen=True):
    """How the engine process computes on a CPU, as `/forward` and `/serve-config` report it."""

    cores_usable: int  # the CPUs this process may run on (its affinity mask)
    torch_threads: int  # intra-op threads (OpenMP) of every product and pointwise op
    torch_interop_threads: int
    omp_num_threads: str | None  # the environment's OMP_NUM_THREADS, if set
    allocator: str  # "glibc", or the library LD_PRELOAD puts first (tcmalloc, jemalloc)
    onednn_linear_layers: int  # linear layers multiplying through oneDNN's prepacked weights
    panel_linear_layers: int = 0  # through Metrale's panel kernel (float32, kernels built)


class ForwardInfo(msgspec.Struct, frozen=True):
    """What the model's forward is, as `/forward` reports it."""

    architecture: str
    model_type: str
    dtype: str
    device: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    sliding_window: int | None
    attention_backend: str
    kernels: dict[str, str]  # what runs each part of the layer
    programmatic_dependent_launch: bool
    cuda_graph_batch_sizes: list[int]
    # The padded token counts of steps with prompt tokens captured in pieces (piecewise_graphs)
    cuda_graph_token_counts: list[int]
    compiled_decode: bool  # a CPU's decode steps run compiled (runner/compiled_decode)
    kv_cache_dtype: str
    kv_block_size: int
    num_kv_blocks: int
    async_scheduling: bool
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine cores; this one's figures are core 0's
    # Under tensor parallelism: the group's backend, each rank's device, one rank's heads
    communication_backend: str | None = None
    rank_devices: list[str] = []
    num_heads_per_rank: int = 0
    num_kv_heads_per_rank: int = 0
    quantization: str | None = None
    cpu_threads: CPUThreads | None = None  # on a CPU


class Ready(msgspec.Struct, frozen=True):
    kv_cache: KVCacheStats
    forward: ForwardInfo


class Outputs(msgspec.Struct, frozen=True):
    """The outputs of one or more engine steps, and the pool's state after them.

    `rejected` lists (request_id, message) for requests the engine refused; they never ran.
    """

    outputs: list[EngineOutput]
    kv_cache: KVCacheStats
    rejected: list[tuple[str, str]]
    steps: list[StepStats] = msgspec.field(default_factory=list)
    # Under data parallelism (set in the API process, data_parallel_client.py): the core that
    # sent it, `kv_cache` summed over every core, and each core's own (None: not heard from yet)
    engine: int = 0
    engines: list[KVCacheStats | None] | None = None


class Failed(msgspec.Struct, frozen=True):
    """The engine core hit an error it cannot recover from and is exiting."""

    message: str


_encoder = msgspec.msgpack.Encoder()
_DECODE_TYPES: dict[MessageKind, type] = {
    MessageKind.ADD: EngineRequest,
    MessageKind.ABORT: list[str],
    MessageKind.SHUTDOWN: type(None),
    MessageKind.READY: Ready,
    MessageKind.OUTPUTS: Outputs,
    MessageKind.FAILED: Failed,
}
_decoders = {kind: msgspec.msgpack.Decoder(t) for kind, t in _DECODE_TYPES.items()}


def encode(kind: MessageKind, payload: object) -> list[bytes]:
    return [kind.value, _encoder.encode(payload)]


def decode(frames: list[bytes]) -> tuple[MessageKind, object]:
    kind = MessageKind(frames[0])
    return kind, _decoders[kind].decode(frames[1])
