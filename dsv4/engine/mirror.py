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
    VERIFY   speculative decoding (`dsv4.engine.spec_step`): a step's rows through the main model,
             eagerly (`pack_rows`: prompt chunks, plain decodes, verifies [x_c, d_1 .. d_n] of rank 0's
             drafts); with a DSpark draft the step's context is written too
    DRAFT    the draft after a VERIFY, on the tokens rank 0 accepted and drew: the MTP block's catch-up
             rows, then before each further link rank 0's drafts [n], which the link reads on every
             worker; or the DSpark blocks of rank 0's anchors (what they draft only rank 0 reads)
    FIXED    the fixed-shape greedy speculative step (a graph, or eagerly): its integers [B, w + 4]
             (tokens, draft counts, starts, table rows); inside it rank 0's accepted lengths and next
             tokens [2, B] (and the MTP block's drafts that feed a next link), broadcast where they are
             decided, before the draft reads them
    STOP     the end

A message is a header of 8 integers, then (STEP, TABLES) the staging buffer or (VERIFY, DRAFT) a list of
integers, all broadcast from rank 0 on the workers' group (gloo on CPUs, NCCL on GPUs, where they are
device tensors). Rank 0 sends the changed page-table rows (TABLES) before a speculative message, so that
nothing changes a table during its device work. Steps are always bucketed here: a bucket is named by two
integers, and every worker captured the same graphs in the same order. A fixed-shape speculative graph
(per batch bucket and width) is captured when rank 0 first needs one, on every worker at the same point:
its FIXED header comes before the capture. A follower decides nothing: every token, accepted length and
draft it runs on is rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .batch import Row

STOP, STEP, TABLES, RESTORE, VERIFY, DRAFT, FIXED = 0, 1, 2, 3, 4, 5, 6
HEADER = 8


class Mirror:
    """Rank 0's side (`send`) and the followers' (`recv`) of the step messages, on one process group."""

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, on_stop: Callable[[], None] | None = None
    ):
        self.group = group
        self.on_stop = on_stop  # rank 0: called before STOP goes out (the followers' exits are expected then)
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
        if kind == STOP and self.on_stop is not None:
            self.on_stop()
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

    def send_ints(self, kind: int, ints: list[int], *values: int) -> None:
        """Rank 0: a message whose payload is a list of integers (the header: kind, its length, values)."""
        self.send(kind, len(ints), *values)
        if ints:
            self.tensor(torch.tensor(ints, dtype=torch.long, device=self.device))

    def recv_ints(self, n: int) -> list[int]:
        """A follower: the payload of n integers announced by the header just received."""
        if not n:
            return []
        t = torch.empty(n, dtype=torch.long, device=self.device)
        self.tensor(t)
        return t.tolist()


def pack_rows(rows: list[Row]) -> list[int]:
    """Rows of an eager step as integers: per row its length, start, table row, flags, feed and tokens."""
    out: list[int] = []
    for r in rows:
        out += [len(r.tokens), r.start, r.state, int(r.want_logits) | int(r.all_logits) << 1, r.feed, *r.tokens]
    return out


def unpack_rows(ints: list[int]) -> list[Row]:
    rows, at = [], 0
    while at < len(ints):
        n, start, state, flags, feed = ints[at : at + 5]
        rows.append(Row(ints[at + 5 : at + 5 + n], start, state, bool(flags & 1), bool(flags & 2), feed))
        at += 5 + n
    return rows
