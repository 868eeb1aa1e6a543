"""The engine on N worker processes: rank 0 schedules, every rank runs the same device work.

With the routed experts split over the workers and attention replicated (`dsv4.parallel`), every worker
must run each step on the same inputs, since every MoE layer is a collective. Rank 0 holds the engine
(scheduler, outputs); ranks 1..N-1 run `follow`, a loop that receives each piece of device work rank 0's
runner does and does it too:

    STEP     the step's integers (the staging buffer: fields, changed page-table rows, sampling settings),
             then the bucket's graph (or eager step); then rank 0's sampled tokens, which the next step's
             decode rows read on every worker, so that no worker ever runs on a token it drew itself
    TABLES   changed page-table rows alone
    RESTORE  a prefix-cache hit's ring rows copied from a page's tail
    STOP     the end

A message is a header of 8 integers, then (STEP, TABLES) the staging buffer, both broadcast from rank 0 on
the workers' group (gloo on CPUs, NCCL on GPUs, where they are device tensors). Steps are always bucketed
here: a bucket is named by two integers, and every worker captured the same graphs in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

STOP, STEP, TABLES, RESTORE = 0, 1, 2, 3
HEADER = 8


class Mirror:
    """Rank 0's side (`send`) and the followers' (`recv`) of the step messages, on one process group."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.cuda = device.type == "cuda"
        self.header = torch.zeros(HEADER, dtype=torch.long, device=device)
        self._host = torch.zeros(HEADER, dtype=torch.long, pin_memory=self.cuda)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def send(self, kind: int, *values: int) -> None:
        """Rank 0: announce a message (the header: kind and up to 7 integers)."""
        self._host.zero_()
        self._host[0] = kind
        for i, v in enumerate(values):
            self._host[1 + i] = int(v)
        self.header.copy_(self._host, non_blocking=self.cuda)
        dist.broadcast(self.header, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)

    def recv(self) -> list[int]:
        """A follower: the next header (waits for rank 0)."""
        dist.broadcast(self.header, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return self.header.tolist()

    def tensor(self, t: torch.Tensor) -> None:
        """The payload of a message, rank 0's `t` into every follower's `t` (same shape and dtype)."""
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
