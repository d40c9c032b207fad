"""Where the tensor-parallel ranks run: one host, or several (`--nnodes`).

The ranks split evenly over the nodes, in order: node `r` runs ranks `r * per_node` to
`(r + 1) * per_node - 1`, on its GPUs 0..per_node-1 (or as CPU processes). Node 0 runs the API
server and the engine core, which is rank 0; every other node runs `met serve` with its
`--node-rank` and only starts its ranks, which join rank 0's group at `--master-addr`:
`--master-port` (torch.distributed's TCP rendezvous, as torchrun, Slurm and Kubernetes set up
with MASTER_ADDR and MASTER_PORT, which are the flags' defaults; NNODES and NODE_RANK are
too). On one host with no address given, the group meets on a free local port.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes={self.nnodes} is out of range: must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank={self.node_rank} is out of range for nnodes={self.nnodes}: must be "
                f"in [0, {self.nnodes})"
            )
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise ValueError(
                f"nnodes={self.nnodes}: every node needs node 0's address, --master-addr and "
                "--master-port (or MASTER_ADDR and MASTER_PORT)"
            )

    @classmethod
    def from_flags(
        cls,
        nnodes: int | None,
        node_rank: int | None,
        master_addr: str | None,
        master_port: int | None,
    ) -> Launch:
        """The flags, else the environment torchrun, Slurm or Kubernetes set, else one node."""
        env = os.environ
        port = master_port if master_port is not None else env.get("MASTER_PORT")
        return cls(
            nnodes=nnodes if nnodes is not None else int(env.get("NNODES", 1)),
            node_rank=node_rank if node_rank is not None else int(env.get("NODE_RANK", 0)),
            master_addr=master_addr or env.get("MASTER_ADDR"),
            master_port=None if port is None else int(port),
        )

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={world_size} does not split over nnodes={self.nnodes}: "
                "every node runs as many ranks"
            )
        return world_size // self.nnodes

    def local_ranks(self, world_size: int) -> range:
        """The ranks this node runs."""
        per_node = self.ranks_per_node(world_size)
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def init_method(self, offset: int = 0) -> str:
        """torch.distributed's rendezvous: node 0's address (at the port past the master's by
        `offset`: each data-parallel core's group meets apart), else a free port of this host
        (call once, on the node that starts the ranks it hands it to)."""
        if self.master_addr is not None and self.master_port is not None:
            return f"tcp://{self.master_addr}:{self.master_port + offset}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"
