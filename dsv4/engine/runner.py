"""The model runner: a scheduled step in, sampled tokens out, with the host off the device's critical path.

Per step (`launch`), with no host synchronization:
1. the host writes the step's integers (token ids, positions, rows, indexer groups, changed page-table rows,
   sampling settings) into a pinned buffer (`batch`), and one asynchronous copy sends them to the device;
2. the changed page-table rows are written into the device's tables;
3. the model runs: a CUDA graph of the step's bucket is replayed (every bucket is captured at start-up), or,
   where no bucket fits (or on a CPU), the same step runs eagerly;
4. the sampler draws each row's token on the device; the tokens stay on the device for the next step's
   input (`feed`) and are copied to another pinned buffer, after which an event is recorded.
`InFlight.read` waits for that event. The engine launches step N+1 before reading step N's tokens, so the
host's scheduling and bookkeeping of step N overlap the device's work on step N+1.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import ops
from ..model import DeepSeekV4
from ..model.paged import PagedKVCache, StepInputs
from ..ops.cuda_graphs import capturing
from .batch import HEAL_ROWS, Bucket, Fields, KeepRule, Row, fill_bucket, ragged_fields, step_inputs
from .cache_manager import BlockTables
from .mirror import RESTORE, STEP, STOP, TABLES, Mirror
from .sampling import SampleOutput, Sampler, SamplingParams, SamplingTensors

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SLOT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # (steps of 1.5x: a step pads
# under a third)
GRAPH_BUCKETS = DECODE_BUCKETS  # batch sizes of the fixed-shape speculative step
TOP_LOGPROBS = 20  # the most alternatives a request may ask for


def bucket_sizes(limit: int, sizes: tuple[int, ...]) -> list[int]:
    """0, the sizes below limit, and limit itself."""
    return [0] + [s for s in sizes if s < limit] + [limit]


@dataclass(slots=True)
class SampleRow:
    """A row to sample: its logits row, settings, seed and counter (tokens generated so far)."""

    params: SamplingParams
    seed: int
    counter: int
    penalty: tuple[list[int], list[int]] | None = None  # (output tokens, prompt tokens) of a penalized row
    allowed: np.ndarray | None = None  # token healing: the ids the row may draw (None: any; `Runner.heal_rows`)


class Staging:
    """Host -> device transfer of a step's integers: pinned host buffers used in turn (the host fills one
    while the copy from the other may still run) and one device buffer that the graphs read."""

    def __init__(self, n: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.host = [torch.zeros(n, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self.arrays = [h.numpy() for h in self.host]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self._views: dict[tuple[Bucket, int], dict[str, np.ndarray]] = {}

    def begin(self) -> np.ndarray:
        """The host buffer to fill for the next `send` (free once its last copy is done)."""
        ev = self.events[self.turn]
        if ev is not None:
            ev.synchronize()
        return self.arrays[self.turn]

    def views(self, bucket: Bucket) -> dict[str, np.ndarray]:
        """The bucket's field views of the buffer `begin` returned (made once per bucket and buffer)."""
        key = (bucket, self.turn)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = bucket.fields().views(self.arrays[self.turn])
        return v

    def send(self, n: int) -> torch.Tensor:
        """Copy the first n values of the filled buffer to the device (asynchronously on CUDA)."""
        i = self.turn
        self.dev[:n].copy_(self.host[i][:n], non_blocking=self.cuda)
        if self.cuda:
            ev = self.events[i] or torch.cuda.Event()
            ev.record()
            self.events[i] = ev
        self.turn ^= 1
        return self.dev[:n]


class Readback:
    """Device -> host copies of a step's samples into pinned buffers used in turn."""

    def __init__(self, n: int, device: torch.device):
        self.cuda = device.type == "cuda"
        pin = self.cuda
        self.ints = [torch.zeros(n * (1 + TOP_LOGPROBS), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.floats = [torch.zeros(n * (1 + TOP_LOGPROBS), dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.turn = 0

    def copy(self, out: SampleOutput) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        i, self.turn = self.turn, self.turn ^ 1
        n = out.tokens.numel()
        ints, floats = self.ints[i], self.floats[i]
        ints[:n].copy_(out.tokens, non_blocking=self.cuda)
        if out.logprobs is not None:
            floats[:n].copy_(out.logprobs, non_blocking=self.cuda)
        if out.top_ids is not None:
            k = out.top_ids.size(1)
            ints[n : n + n * k].copy_(out.top_ids.flatten(), non_blocking=self.cuda)
            floats[n : n + n * k].copy_(out.top_logprobs.flatten(), non_blocking=self.cuda)
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
        return ints, floats, ev


@dataclass
class InFlight:
    """A launched step: its sampled tokens are on their way to the host."""

    n: int  # rows sampled
    ints: torch.Tensor | None = None
    floats: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    logprobs: bool = False
    top: int = 0
    pick: list[int] | None = None  # sample j's index in the copied arrays (None: j)
    feed: list[int] = field(default_factory=list)  # sample j's index in the device's sampled tokens
    launched: float = field(default_factory=time.perf_counter)

    def read(self) -> tuple[list[int], list[float] | None, list[list[int]] | None, list[list[float]] | None]:
        """(tokens, their log-probabilities, top ids, top log-probabilities) in sample order: waits for the
        device."""
        if self.n == 0:
            return [], None, None, None
        if self.event is not None:
            self.event.synchronize()
        if self.pick is not None:  # the graph drew every out row: take the sampled ones
            m = max(self.pick) + 1
            toks, lps = self.ints[:m].tolist(), self.floats[:m].tolist()
            return [toks[i] for i in self.pick], [lps[i] for i in self.pick], None, None
        n, k = self.n, self.top
        toks = self.ints[:n].tolist()
        lps = self.floats[:n].tolist() if self.logprobs else None
        top_ids = self.ints[n : n + n * k].view(n, k).tolist() if k else None
        top_lps = self.floats[n : n + n * k].view(n, k).tolist() if k else None
        return toks, lps, top_ids, top_lps


class BucketGraph:
    """One bucket's step captured in CUDA graphs: reads its fields from the staging buffer, leaves logits
    [n_out, V] in the runner's logits buffer and every out row's draw in `sampled` / `sample_lp`.

    Two executable graphs of the same step, replayed in turn: launching a graph while its previous launch
    still runs makes the driver wait for it and then push every node again (milliseconds for a ~1500-node
    step, the device idle meanwhile), while a graph that is not running launches in tens of microseconds.
    The engine reads step N-1 before it launches step N+1, so the one launched is never still running.
    Each is replayed once here, so that no request pays for its first upload."""

    def __init__(self, runner: Runner, bucket: Bucket, pool):
        self.bucket = bucket
        self.fields = bucket.fields()
        r = runner
        # a capture on first use comes between two steps: the last one's draws in `sampled` are what the
        # next one feeds (`feed`), and the empty steps below draw into it too, so they are put back after
        drawn = r.sampled.clone()
        host = np.zeros(self.fields.size, np.int64)
        v = self.fields.views(host)
        fill_bucket(bucket, [], [], v, r.tables.pad_row)  # an empty step: all padding
        r.default_sampling(v)
        r.staging.dev[: self.fields.size].copy_(torch.from_numpy(host))
        t = self.fields.views(r.staging.dev)
        dev = r.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile / autotune outside the graph
            for _ in range(2):
                r.bucket_forward(t, bucket)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graphs = []
        for _ in range(2):
            g = torch.cuda.CUDAGraph()
            with capturing(g, pool=pool):
                r.bucket_forward(t, bucket)
            g.replay()  # uploads it (the empty step writes only to trash)
            self.graphs.append(g)
        self.turn = 0
        # the warm-up steps wrote only to the trash page (padding rows) and to the draw buffers
        r.sampled.copy_(drawn)

    def replay(self) -> None:
        self.graphs[self.turn].replay()
        self.turn ^= 1


class Runner:
    """Runs steps of the model on one paged cache (see the module docstring)."""

    def __init__(
        self,
        model: DeepSeekV4,
        cache: PagedKVCache,
        tables: BlockTables,
        *,
        cuda_graphs: bool = False,
        max_decode: int = 64,
        max_slots: int = 0,
        max_prefill_slots: int = 0,
        slot_len: int = 64,
        pad: bool = False,
        mirror: Mirror | None = None,
        mtp: bool = False,
    ):
        """mirror: the engine on several workers (`dsv4.engine.mirror`): every step is bucketed, rank 0 sends
        its device work to the other ranks, which run `follow`. mtp (speculative decoding with the MTP
        block): every bucketed step also runs the block's catch-up on its positions (`bucket_forward`).
        max_prefill_slots: steps with no decode row may hold up to this many chunk slots (buckets of their
        own, `prefill_sizes`: a burst of prompts in fewer steps)."""
        self.model, self.cache, self.tables = model, cache, tables
        self.mtp = mtp
        ops.keep_splits(model)  # its weights are fixed while it serves: fp32 projections split once
        self.device = cache.device
        self.mirror = mirror
        pad = pad or mirror is not None
        self.ratios = cache.layout.ratios
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.pad = pad or self.cuda_graphs  # bucketed steps (eagerly where there are no graphs)
        self.slot_len = slot_len
        self.keep = KeepRule.for_layout(cache.layout, slot_len)  # chunk tokens that leave raw rows
        self.decode_sizes = bucket_sizes(max_decode, DECODE_BUCKETS)
        self.slot_sizes = bucket_sizes(max_slots, SLOT_BUCKETS) if max_slots else [0]
        top = max(self.slot_sizes)
        self.prefill_sizes = [s for s in bucket_sizes(max_prefill_slots, SLOT_BUCKETS) if s > top]
        self.buckets = [self.bucket(d, c) for d in self.decode_sizes for c in self.slot_sizes if d or c]
        self.buckets += [self.bucket(0, c) for c in self.prefill_sizes]
        vocab = model.cfg.vocab_size
        n_out = max(max_decode + top, max(self.prefill_sizes, default=0))
        width = tables.w.shape[1]
        self.max_rows = max(n_out, max_decode * 17, 1)  # sampled rows (verify rows: k + 1 each)
        biggest = max((b.fields().size for b in self.buckets), default=0)
        extras = (
            (tables.w.shape[0]) * (1 + 2 * width)
            + self.max_rows * 5
            + self.max_rows * (SamplingTensors.N_FLOAT + SamplingTensors.N_INT)
        )
        self.staging = Staging(biggest + extras + 1024, self.device)
        self.readback = Readback(self.max_rows, self.device)
        self.tables_w = torch.from_numpy(tables.w).to(self.device)
        self.tables_c = torch.from_numpy(tables.c).to(self.device)
        tables.dirty.clear()
        self.sampled = torch.zeros(self.max_rows, dtype=torch.long, device=self.device)
        self.sample_lp = torch.zeros(self.max_rows, dtype=torch.float32, device=self.device)
        # token healing in a step with the MTP catch-up: up to heal_rows constrained rows are drawn in its graph,
        # their allowed tokens in heal_mask (elsewhere a constrained row is drawn after the graph, eagerly);
        # logits_buf's last heal_rows rows take the masking of the unused ones
        self.heal_rows = HEAL_ROWS if mtp and mirror is None else 0
        self.heal_mask = torch.ones(self.heal_rows, vocab, dtype=torch.bool, device=self.device)
        self.heal_spare = torch.arange(n_out, n_out + HEAL_ROWS, device=self.device)
        rows = n_out + (HEAL_ROWS if mtp else 0)
        self.logits_buf = torch.zeros(rows, vocab, dtype=torch.float32, device=self.device) if self.pad else None
        self.sampler = Sampler()
        self.graphs: dict[Bucket, BucketGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.graph_steps = 0
        self.eager_steps = 0
        self.padded_steps = 0
        # steps by (decode rows, chunk slots) of their bucket, and the real rows they carried
        self.bucket_steps: Counter[tuple[int, int]] = Counter()
        # a speculating engine's fixed-shape steps by (batch bucket, tokens a row) (`dsv4.engine.spec_step`)
        self.fixed_steps: Counter[tuple[int, int]] = Counter()
        self.decode_rows = 0
        self.chunk_tokens = 0  # tokens of multi-token rows: prompt chunks (and speculative verifies)
        self.late_captures = 0  # graphs captured on first use, not at start-up
        self.warmup_seconds = 0.0
        # a list to time steps on the device (`dsv4 bench engine`): each step launched appends (start, end,
        # shape): CUDA events around its device work, from the copy of its inputs to the copy of its tokens,
        # and its bucket's "decode rows+chunk slots" ("ragged" for an unpadded step; a speculating engine's
        # fixed-shape step: "fixed BxS", B rows of S tokens)
        self.clock: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] | None = None
        self._started: torch.cuda.Event | None = None
        self._shape = "ragged"

    # ------------------------------------------------------------------ graphs
    @property
    def graph_pool(self):
        """The memory pool every graph of this runner is captured in (None without graphs)."""
        return self._pool

    def capture_graphs(self, progress=None) -> int:
        """Capture every bucket's graph now (a server does it before it says it is ready, so that no
        request waits for a capture or a kernel compilation). Returns the number of graphs."""
        if not self.cuda_graphs:
            return 0
        t0 = time.perf_counter()
        for i, b in enumerate(sorted(self.buckets, key=lambda b: -b.tokens)):  # largest first: pool sizes
            if b not in self.graphs:
                self.graphs[b] = BucketGraph(self, b, self._pool)
            if progress is not None:
                progress(i + 1, len(self.buckets))
        torch.cuda.synchronize(self.device)
        self.warmup_seconds += time.perf_counter() - t0
        return len(self.graphs)

    def bucket_for(self, n_decode: int, n_slots: int) -> Bucket | None:
        d = next((s for s in self.decode_sizes if s >= n_decode), None)
        c = next((s for s in self.slot_sizes if s >= n_slots), None)
        if c is None and n_decode == 0:  # prompts alone
            c = next((s for s in self.prefill_sizes if s >= n_slots), None)
        if d is None or c is None or not (d or c):
            return None
        return self.bucket(d, c)

    def bucket(self, n_decode: int, n_slots: int) -> Bucket:
        """The bucket of exactly these sizes."""
        return Bucket(n_decode, n_slots, self.slot_len, self.ratios, self.keep, self.mtp)

    # ------------------------------------------------------------------ one step
    def forward(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model on device field views (eager, or recorded into a graph)."""
        tokens, inputs = step_inputs(t, self.ratios, self.tables_w, self.tables_c, self.sampled)
        return self.model.append(tokens, inputs, self.cache)

    def bucket_forward(self, t: dict[str, torch.Tensor], bucket: Bucket) -> None:
        """A bucket's step as its graph holds it: the model, its logits kept, and every out row drawn with
        its settings (the plain draw); tokens into `sampled`, log-probabilities into `sample_lp`."""
        n = bucket.n_out
        if bucket.mtp:
            tokens, inputs = step_inputs(t, self.ratios, self.tables_w, self.tables_c, self.sampled)
            logits, hidden = self.model.append(tokens, inputs, self.cache, return_hidden=True)
        else:
            logits = self.forward(t)
        self.logits_buf[:n].copy_(logits)
        if bucket.mtp and self.heal_rows:  # the constrained rows' disallowed tokens to -inf (spare rows: none)
            h = t["heal"]
            idx = torch.where(h >= 0, h, self.heal_spare)
            rows = self.logits_buf.index_select(0, idx).masked_fill(~self.heal_mask, float("-inf"))
            self.logits_buf.index_copy_(0, idx, rows)
            logits = self.logits_buf[:n]
        st = SamplingTensors.unpack(t["s_f"].view(torch.float64), t["s_i"], None)
        out = self.sampler.sample(logits, st)
        self.sampled[:n].copy_(out.tokens)
        self.sample_lp[:n].copy_(out.logprobs)
        if bucket.mtp:  # the MTP block catches up on every position, its next token now known (its logits unused)
            self.share(self.sampled[:n])  # (several workers: every block reads rank 0's draws)
            nxo = t["nxo"]
            nxt = torch.where(nxo >= 0, self.sampled[nxo.clamp_min(0)], t["nx"])
            self.model.draft(hidden, nxt.view(1, -1), inputs, self.cache)

    def default_sampling(self, v: dict[str, np.ndarray]) -> None:
        """Neutral settings in every out row of a bucket's fields (rows nobody samples)."""
        f = v["s_f"].view(np.float64)
        f[:] = (1.0, 1.0, 0.0, 0.0)
        v["s_i"][:] = (self.model.cfg.vocab_size, 0, 0, 0)

    def _sync_tables(self, host: np.ndarray, at: int) -> int:
        """Pack the page-table rows changed since the last step after `at`; -> the new end."""
        rows = self.tables.take_dirty()
        n = len(rows)
        if not n:
            self._table_update = None
            return at
        width = self.tables.w.shape[1]
        host[at : at + n] = rows
        host[at + n : at + n + n * width] = self.tables.w[rows].reshape(-1)
        host[at + n + n * width : at + n + 2 * n * width] = self.tables.c[rows].reshape(-1)
        self._table_update = (at, n, width)
        return at + n + 2 * n * width

    def _apply_tables(self, dev: torch.Tensor) -> None:
        if self._table_update is None:
            return
        at, n, width = self._table_update
        rows = dev[at : at + n]
        self.tables_w.index_copy_(0, rows, dev[at + n : at + n + n * width].view(n, width))
        self.tables_c.index_copy_(0, rows, dev[at + n + n * width : at + n + 2 * n * width].view(n, width))

    def sync_tables(self) -> None:
        """Bring the device's page tables up to date now (steps that do not go through `launch`). A
        follower's tables change only by rank 0's messages: nothing to do there."""
        if self.mirror is not None and not self.mirror.leader:
            return
        host = self.staging.begin()
        end = self._sync_tables(host, 0)
        if end:
            dev = self.staging.send(end)
            if self.mirror is not None:
                self.mirror.send(TABLES, end, *self._table_update[:2])
                self.mirror.tensor(dev)
            self._apply_tables(dev)

    def announce(self, kind: int, ints: list[int], *values: int) -> None:
        """Rank 0 of several workers: the changed page-table rows, then a message of device work that the
        followers do with it (`dsv4.engine.mirror`); nothing on one process."""
        if self.mirror is not None:
            self.sync_tables()
            self.mirror.send_ints(kind, ints, *values)

    def share(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t in every worker's t (a value rank 0 decided, which the following device work reads on
        every worker; capturable in a CUDA graph on NCCL). -> t."""
        if self.mirror is not None:
            self.mirror.tensor(t)
        return t

    def restore_tail(self, state: int, cpage: int, end: int) -> None:
        """A prefix-cache hit: the sequence's ring rows from the page's tail (`PagedKVCache.restore_tail`)."""
        if self.mirror is not None:
            self.mirror.send(RESTORE, state, cpage, end)
        self.cache.restore_tail(state, cpage, end)

    def launch(self, decode: list[Row], chunks: list[Row], samples: list[tuple[int, SampleRow]]) -> InFlight:
        """Run one step: decode rows (one token each) then prompt chunks; sample the rows listed in
        `samples` as (index of the row in decode + chunks, settings). -> the step in flight."""
        if self.clock is None or self.device.type != "cuda":
            return self._launch(decode, chunks, samples)
        inflight = self._launch(decode, chunks, samples)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.clock.append((self._started, end, self._shape))
        return inflight

    def _launch(self, decode: list[Row], chunks: list[Row], samples: list[tuple[int, SampleRow]]) -> InFlight:
        n_slots = sum(-(-len(r.tokens) // self.slot_len) for r in chunks)
        bucket = self.bucket_for(len(decode), n_slots) if self.pad else None
        if self.mirror is not None and bucket is None:
            raise RuntimeError(f"a step of {len(decode)} rows and {n_slots} chunk slots fits no bucket")
        if bucket is not None and self.cuda_graphs and bucket not in self.graphs and self.mirror is None:
            self.graphs[bucket] = BucketGraph(self, bucket, self._pool)  # (a server captured them all)
            self.late_captures += 1
        if bucket is not None:
            self.bucket_steps[bucket.decode, bucket.slots] += 1
        self._shape = "ragged" if bucket is None else f"{bucket.decode}+{bucket.slots}"
        self.decode_rows += len(decode)
        self.chunk_tokens += sum(len(r.tokens) for r in chunks)
        n = len(samples)
        params = [s.params for _, s in samples]
        vocab = self.model.cfg.vocab_size
        host = self.staging.begin()
        if bucket is not None:
            fields = bucket.fields()
            v = self.staging.views(bucket)
            logits_rows = fill_bucket(bucket, decode, chunks, v, self.tables.pad_row)
            self.default_sampling(v)
            out_rows = [logits_rows[i] for i, _ in samples]
            if n:
                f, g = np.empty((n, SamplingTensors.N_FLOAT)), np.empty((n, SamplingTensors.N_INT), np.int64)
                SamplingTensors.pack(params, [s.seed for _, s in samples], [s.counter for _, s in samples], vocab, f, g)
                v["s_f"].view(np.float64)[out_rows] = f
                v["s_i"][out_rows] = g
        else:
            fields, arr, logits_rows = ragged_fields(decode + chunks, self.ratios, self.tables.pad_row)
            host[: fields.size] = arr
            out_rows = [logits_rows[i] for i, _ in samples]
        at = self._sync_tables(host, fields.size)
        constrained = [s.allowed for _, s in samples]
        healing = [j for j, c in enumerate(constrained) if c is not None]
        in_graph = bucket is not None and bucket.mtp and len(healing) <= self.heal_rows  # (mask applied there)
        plain = bucket is not None and SamplingTensors.plain(params) and (not healing or in_graph)
        if plain and healing:
            v["heal"][: len(healing)] = [out_rows[j] for j in healing]
            self.heal_mask[: len(healing)].copy_(self.allowed_mask([constrained[j] for j in healing]))
        if self.mtp and n and not plain:  # its MTP catch-up reads the graph's draws
            raise RuntimeError("a step with the MTP catch-up must be bucketed and draw every row in its graph")
        pick = sf = si = None
        if not plain and n:  # rows drawn eagerly: their logits rows and settings
            pick = at
            host[pick : pick + n] = out_rows
            sf, si = pick + n, pick + n + n * SamplingTensors.N_FLOAT
            at = si + n * SamplingTensors.N_INT
            SamplingTensors.pack(
                params,
                [s.seed for _, s in samples],
                [s.counter for _, s in samples],
                vocab,
                host[sf:si].view(np.float64).reshape(n, -1),
                host[si:at].reshape(n, -1),
            )
        if self.clock is not None and self.device.type == "cuda":  # (a step's first device work: this copy)
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        dev = self.staging.send(at)
        if self.mirror is not None:
            update = self._table_update[:2] if self._table_update is not None else (0, 0)
            self.mirror.send(STEP, at, bucket.decode, bucket.slots, *update)
            self.mirror.tensor(dev)
        self._apply_tables(dev)
        if bucket is not None:
            if bucket in self.graphs:
                self.graphs[bucket].replay()
                self.graph_steps += 1
            else:
                self.bucket_forward(fields.views(dev), bucket)
                self.eager_steps += 1
                self.padded_steps += 1
            logits = self.logits_buf
        else:
            logits = self.forward(fields.views(dev))
            self.eager_steps += 1
        if not n:
            if self.mirror is not None:
                self.mirror.tensor(self.sampled[: bucket.n_out])
            return InFlight(0)
        if plain:  # the graph drew them: copy every out row's token back
            if self.mirror is not None:  # every worker's next step reads rank 0's tokens
                self.mirror.tensor(self.sampled[: bucket.n_out])
            ints, floats, ev = self.readback.copy(
                SampleOutput(self.sampled[: bucket.n_out], self.sample_lp[: bucket.n_out])
            )
            return InFlight(n, ints, floats, ev, True, 0, pick=out_rows, feed=out_rows)
        rows = dev[pick : pick + n]
        st = SamplingTensors.unpack(dev[sf:si].view(torch.float64).view(n, -1), dev[si:at].view(n, -1), params)
        penalties = None
        if any(p.penalized for p in params):
            penalties = (params, *self._penalty_inputs([s for _, s in samples]))
        out = self.sampler.sample(logits[rows], st, penalties, self.allowed_mask(constrained))
        if bucket is not None:  # sampled tokens live at their out rows, as the graph's do
            self.sampled.index_copy_(0, rows, out.tokens)
            feed = out_rows
            if self.mirror is not None:
                self.mirror.tensor(self.sampled[: bucket.n_out])
        else:
            self.sampled[:n].copy_(out.tokens)
            feed = list(range(n))
        ints, floats, ev = self.readback.copy(out)
        return InFlight(
            n,
            ints,
            floats,
            ev,
            out.logprobs is not None,
            out.top_ids.size(1) if out.top_ids is not None else 0,
            feed=feed,
        )

    def follow(self, other: Callable[[int, list[int]], None] | None = None) -> None:
        """A worker other than rank 0: do rank 0's device work, message by message, until STOP. other(kind,
        header values) does the messages of speculative decoding (VERIFY, DRAFT, FIXED)."""
        width = self.tables.w.shape[1]
        while True:
            header = self.mirror.recv()
            kind, n, a, b, t_at, t_n, _, _ = header
            if kind == STOP:
                return
            if kind == RESTORE:
                self.cache.restore_tail(n, a, b)
                continue
            if kind not in (STEP, TABLES):
                if other is None:
                    raise RuntimeError(f"message {kind} from rank 0, and this engine does not speculate")
                other(kind, header[1:])
                continue
            dev = self.staging.dev[:n]
            self.mirror.tensor(dev)
            if kind == TABLES:
                t_at, t_n = a, b
            self._table_update = (t_at, t_n, width) if t_n else None
            self._apply_tables(dev)
            if kind != STEP:
                continue
            bucket = self.bucket(a, b)
            if bucket in self.graphs:
                self.graphs[bucket].replay()
                self.graph_steps += 1
            else:
                self.bucket_forward(bucket.fields().views(dev), bucket)
                self.eager_steps += 1
            self.mirror.tensor(self.sampled[: bucket.n_out])

    def stop_followers(self) -> None:
        if self.mirror is not None and self.mirror.leader:
            self.mirror.send(STOP)

    def allowed_mask(self, allowed: list[np.ndarray | None]) -> torch.Tensor | None:
        """[B, V] bool on the device, the tokens each row may draw (True everywhere for a row without a
        constraint), or None when no row has one."""
        if all(a is None for a in allowed):
            return None
        V = self.model.cfg.vocab_size
        mask = np.ones((len(allowed), V), np.bool_)
        for i, a in enumerate(allowed):
            if a is not None:
                mask[i] = False
                mask[i, a[a < V]] = True
        return torch.from_numpy(mask).to(self.device)

    def _penalty_inputs(self, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Output-token counts and prompt-token masks [B, V] (penalized rows only; others stay zero)."""
        V, dev = self.model.cfg.vocab_size, self.device
        counts = np.zeros((len(rows), V), np.int64)
        mask = np.zeros((len(rows), V), np.bool_)
        for i, r in enumerate(rows):
            if r.penalty is None:
                continue
            out, prompt = r.penalty
            np.add.at(counts[i], np.asarray(out, np.int64), 1)
            mask[i, np.asarray(prompt, np.int64)] = True
        return torch.from_numpy(counts).to(dev), torch.from_numpy(mask).to(dev)

    # ------------------------------------------------------------------ eager helpers (speculative decoding)
    def inputs(self, rows: list[Row]) -> tuple[torch.Tensor, StepInputs, list[int]]:
        """(tokens [1, T], StepInputs, logits row of each row (-1: none)) for ragged rows, eagerly."""
        self.sync_tables()
        fields, arr, logits_rows = ragged_fields(rows, self.ratios, self.tables.pad_row)
        t = Fields.views(fields, torch.from_numpy(arr).to(self.device))
        tokens, inputs = step_inputs(t, self.ratios, self.tables_w, self.tables_c, None)
        return tokens, inputs, logits_rows

    def run_hidden(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """An eager step that also returns the hidden states [T, hc, dim] (the MTP draft's input):
        (logits [n, vocab] of the rows that want them, hidden, logits row of each such row)."""
        tokens, inputs, logits_rows = self.inputs(rows)
        self.eager_steps += 1
        logits, hidden = self.model.append(tokens, inputs, self.cache, return_hidden=True)
        return logits, hidden, logits_rows
