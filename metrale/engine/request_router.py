"""Which data-parallel engine core serves a request: prefix-cache affinity first, then load.

Each core has its own prefix cache, so a prompt served where its beginning was served before
skips that prefill. The router remembers, for the beginnings of the prompts it routed, which
core took them: a prompt's first 1, 2, 4, 8, ... full KV blocks and all of its full blocks are
hashed (each hash chained on the one before, as the prefix cache chains its block hashes), and
the core that took the deepest one already seen is the prompt's choice: a conversation's next
turn, whose prompt is the last turn's prompt and answer plus more, goes where the last turn went;
prompts that share only a system prompt match at a shallower depth and spread by load. A core
more than `slack` requests busier than the least loaded one is passed over for the least loaded
(ties: the lower index). The table is bounded (`max_entries`, least recently used forgotten).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class RequestRouter:
    def __init__(
        self, num_cores: int, block_size: int, slack: int = 4, max_entries: int = 65_536
    ) -> None:
        self.num_cores = num_cores
        self.block_size = block_size
        self.slack = slack
        self.max_entries = max_entries
        self.load = [0] * num_cores  # unfinished requests routed to each core
        self.num_affine = 0  # requests routed by affinity (the rest: by load)
        self._owners: OrderedDict[int, int] = OrderedDict()  # prefix hash -> core

    def route(self, prompt_token_ids: Sequence[int]) -> int:
        """The core for a new request of this prompt; it counts as that core's load until
        `finished`."""
        keys = self._prefix_keys(prompt_token_ids)
        least = min(range(self.num_cores), key=self.load.__getitem__)
        core = least
        for key in reversed(keys):
            owner = self._owners.get(key)
            if owner is not None:
                if self.load[owner] <= self.load[least] + self.slack:
                    core = owner
                    self.num_affine += 1
                break
        for key in keys:
            self._owners[key] = core
            self._owners.move_to_end(key)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)
        self.load[core] += 1
        return core

    def finished(self, core: int) -> None:
        self.load[core] -= 1

    def _prefix_keys(self, token_ids: Sequence[int]) -> list[int]:
        """Hashes of the prompt's first 1, 2, 4, ... full blocks and of all its full blocks,
        shallowest first."""
        num_blocks = len(token_ids) // self.block_size
        keys, h, depth = [], 0, 1
        for i in range(num_blocks):
            block = token_ids[i * self.block_size : (i + 1) * self.block_size]
            h = hash((h, tuple(block)))
            if i + 1 == depth:
                keys.append(h)
                depth *= 2
            elif i + 1 == num_blocks:
                keys.append(h)
        return keys
