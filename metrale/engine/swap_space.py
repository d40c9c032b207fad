"""The host pool that preempted requests' KV blocks are swapped out to, and the choice to use it.

When the device pool runs dry the scheduler preempts a running request. It may free the
request's blocks and recompute its tokens later (a prefill of everything it has so far), or
copy the blocks to host memory now and back when it resumes. `SwapSpace` holds the host blocks
(`--swap-space-gb` of them; pinned memory next to a GPU, plain memory on a CPU), which request
holds which, and what each way costs on this machine: the copy bandwidth and the prefill time
per token, both measured at startup (`SwapCosts`). A victim is swapped when moving its blocks
out and back is cheaper than recomputing its tokens and the host pool has room; otherwise it
is recomputed as before. `--preemption-mode swap` swaps whenever there is room (vLLM's V0 flag;
tests use it), `recompute` never.

Only the blocks move: the request itself (its tokens, sampling and penalty state, grammar,
thinking counters, watchdog, deadline) stays where it is, in the scheduler's queue, so nothing
needs carrying across; a seeded request's draws follow from its seed and positions alone
(`runner/random_draws.py`). Host blocks are read and written only by
copies queued on the device's stream, in step order: a host block freed at a swap-in may be
taken by the next swap-out at once.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class SwapCosts:
    """This machine's figures, measured at startup: bytes a second between device and host
    (one direction, the slower), and the seconds a prefill takes per token."""

    copy_bytes_per_s: float
    prefill_s_per_token: float


class SwapStats(msgspec.Struct, frozen=True):
    """The host pool and its traffic so far; read by `/memory`."""

    num_blocks: int
    num_used_blocks: int
    bytes_per_block: int
    num_swapped_requests: int  # waiting now with their blocks on the host
    num_swap_outs: int  # victims swapped out so far (the others are recomputed)
    blocks_out: int
    blocks_in: int
    copy_s: float  # the device's time for the copies, both directions
    copy_bytes_per_s: float
    prefill_s_per_token: float


class SwapSpace:
    def __init__(
        self, num_blocks: int, bytes_per_block: int, costs: SwapCosts, mode: str = "auto"
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: a swap space needs at least one block")
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.costs = costs
        self.mode = mode  # SchedulerConfig.preemption_mode
        # Lowest ids first: a request's blocks then tend to be one run, copied in one transfer.
        self._free = list(range(num_blocks))
        self._held: dict[str, list[int]] = {}
        self.num_swap_outs = 0
        self.blocks_out = 0
        self.blocks_in = 0
        self.copy_s = 0.0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether a victim's `num_blocks` go to the host rather than its `num_tokens` being
        recomputed: they fit, and moving them out and back is the cheaper (mode auto)."""
        if self.mode == "recompute" or num_blocks == 0 or num_blocks > len(self._free):
            return False
        if self.mode == "swap":
            return True
        copy_s = 2 * num_blocks * self.bytes_per_block / self.costs.copy_bytes_per_s
        return copy_s < num_tokens * self.costs.prefill_s_per_token

    def swap_out(self, request_id: str, device_blocks: list[int]) -> list[tuple[int, int]]:
        """Host blocks for a victim's device blocks: the (device, host) pairs to copy."""
        host = [heapq.heappop(self._free) for _ in device_blocks]
        self._held[request_id] = host
        self.num_swap_outs += 1
        self.blocks_out += len(host)
        return list(zip(device_blocks, host, strict=True))

    def host_blocks(self, request_id: str) -> list[int]:
        return self._held[request_id]

    def swap_in(
        self, request_id: str, device_blocks: list[int], skip: int
    ) -> list[tuple[int, int]]:
        """The (host, device) pairs that bring a request back into the first of its new
        `device_blocks`, past the first `skip` (found still cached on the device); its host
        blocks are free after (the copies are queued before any later one)."""
        host = self._held[request_id]
        pairs = list(zip(host[skip:], device_blocks[skip : len(host)], strict=True))
        self.blocks_in += len(pairs)
        self.free(request_id)
        return pairs

    def free(self, request_id: str) -> None:
        for block in self._held.pop(request_id, ()):
            heapq.heappush(self._free, block)

    def stats(self) -> SwapStats:
        return SwapStats(
            num_blocks=self.num_blocks,
            num_used_blocks=self.num_blocks - len(self._free),
            bytes_per_block=self.bytes_per_block,
            num_swapped_requests=len(self._held),
            num_swap_outs=self.num_swap_outs,
            blocks_out=self.blocks_out,
            blocks_in=self.blocks_in,
            copy_s=self.copy_s,
            copy_bytes_per_s=self.costs.copy_bytes_per_s,
            prefill_s_per_token=self.costs.prefill_s_per_token,
        )
