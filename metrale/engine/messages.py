"""Every message between the API process and the engine-core process, in one module.

Messages are msgspec-encoded (msgpack) and framed as [kind, payload] ZMQ multipart messages;
the kind tells the receiver which type to decode the payload into. Requests and outputs reuse
the engine's own dataclasses, so nothing is converted on either side.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from metrale.engine.core import EngineRequest
from metrale.engine.request import EngineOutput


class MessageKind(bytes, enum.Enum):
    # API -> engine
    ADD = b"add"
    ABORT = b"abort"
    SHUTDOWN = b"shutdown"
    # engine -> API
    READY = b"ready"
    OUTPUTS = b"outputs"
    FAILED = b"failed"


@dataclass(frozen=True)
class KVCacheStats:
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

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


@dataclass(frozen=True)
class Ready:
    kv_cache: KVCacheStats


@dataclass(frozen=True)
class Outputs:
    """The outputs of one or more engine steps, and the pool's state after them.

    `rejected` lists (request_id, message) for requests the engine refused; they never ran.
    """

    outputs: list[EngineOutput]
    kv_cache: KVCacheStats
    rejected: list[tuple[str, str]]


@dataclass(frozen=True)
class Failed:
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
