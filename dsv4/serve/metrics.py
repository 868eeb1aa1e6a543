"""Prometheus metrics of the server (`GET /metrics`), in a registry of its own.

With several HTTP processes (`dsv4 serve --api-servers N`) every process writes its metrics to files in
one directory (prometheus_client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`, set before
prometheus_client is imported), and `/metrics`, whichever process answers it, reads them all: counters and
histograms are summed over the processes; the engine's own figures (gauges, token and step counters,
phases) are written by the first process only (`engine_wide`), since every process sees them.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values

from .warmup import WARMUP_PREFIX

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# the parts of a time to first token: milliseconds on a GPU, so finer at the low end
_TTFT_PARTS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 10, 60)
_VERIFY_LENGTHS = tuple(range(16))  # drafts one verify checks: 0 ... MAX_SPECULATIVE


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _gauge(name: str, doc: str, labels: list[str], registry: CollectorRegistry) -> Gauge:
    # one process writes each engine gauge; "mostrecent" reads its value in multiprocess mode
    return Gauge(name, doc, labels, registry=registry, multiprocess_mode="mostrecent")


class ServerMetrics:
    def __init__(self, model_name: str, engine_wide: bool = True):
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV)
        if self.multiprocess_dir and values.ValueClass is values.MutexValue:
            raise RuntimeError(f"{MULTIPROC_ENV} was set after prometheus_client was imported")
        self.engine_wide = engine_wide
        self.registry = r = CollectorRegistry()
        labels = ["model"]
        self.running = _gauge("dsv4_requests_running", "sequences running in the engine", labels, r)
        self.waiting = _gauge("dsv4_requests_waiting", "sequences waiting for admission", labels, r)
        self.cache_usage = _gauge(
            "dsv4_cache_usage_ratio", "fraction of cache pages held by running sequences", labels, registry=r
        )
        self.tokens_per_s = _gauge(
            "dsv4_generation_tokens_per_second", "output tokens per second over the last step", labels, registry=r
        )
        self.prompt_tokens = Counter("dsv4_prompt_tokens", "prompt tokens computed", labels, registry=r)
        self.generation_tokens = Counter("dsv4_generation_tokens", "tokens generated", labels, registry=r)
        self.prefix_hits = Counter(
            "dsv4_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", labels, registry=r
        )
        self.preemptions = Counter("dsv4_preemptions", "sequences preempted for memory", labels, registry=r)
        self.requests = Counter(
            "dsv4_requests_finished", "finished sequences by reason", labels + ["reason"], registry=r
        )
        self.ttft = Histogram(
            "dsv4_time_to_first_token_seconds",
            "time from arrival to the first token",
            labels,
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            "dsv4_request_queue_seconds",
            "time from the engine's receipt of a sequence to its admission (a seat, cache pages, the step's budget)",
            labels,
            buckets=_TTFT_PARTS,
            registry=r,
        )
        self.prefill = Histogram(
            "dsv4_request_prefill_seconds",
            "time from a sequence's admission to its first token (the steps of its prompt)",
            labels,
            buckets=_TTFT_PARTS,
            registry=r,
        )
        self.transport = Histogram(
            "dsv4_request_transport_seconds",
            "the time to first token outside the engine's queue and prefill: the request's way to the engine "
            "process and the first output's way back through the HTTP process's event loop",
            labels,
            buckets=_TTFT_PARTS,
            registry=r,
        )
        self.itl = Histogram(
            "dsv4_inter_token_latency_seconds", "time between a sequence's tokens", labels, buckets=_LATENCY, registry=r
        )
        self.e2e = Histogram(
            "dsv4_request_latency_seconds", "time from arrival to the last token", labels, buckets=_LATENCY, registry=r
        )
        self.step = Histogram(
            "dsv4_engine_step_seconds", "duration of one engine step", labels, buckets=_LATENCY, registry=r
        )
        self.phase = Counter(
            "dsv4_engine_phase_seconds",
            "engine process time by phase: a step's schedule, launch, wait for the device and post-processing; "
            "io (commands in, results out) and idle (no work)",
            labels + ["phase"],
            registry=r,
        )
        self.spec_drafted = Counter(
            "dsv4_spec_draft_tokens",
            "draft tokens verified (proposed by the MTP block or the DSpark draft)",
            labels,
            registry=r,
        )
        self.spec_accepted = Counter(
            "dsv4_spec_accepted_tokens", "draft tokens the target accepted", labels, registry=r
        )
        self.spec_verifies = Counter(
            "dsv4_spec_verify_steps", "sequence-steps that verified drafts", labels, registry=r
        )
        self.spec_rate = _gauge(
            "dsv4_spec_acceptance_ratio", "accepted / proposed draft tokens since start", labels, registry=r
        )
        self.spec_lengths = Histogram(
            "dsv4_spec_verify_length",
            "drafts verified per decode row of a speculating "
            "sequence (DSpark: the confidence head's choice, at most K; 0: it decoded "
            "plainly)",
            labels,
            buckets=_VERIFY_LENGTHS,
            registry=r,
        )
        self.spec_per_step = _gauge(
            "dsv4_spec_tokens_per_verify",
            "mean tokens a verify step yields (accepted drafts + 1) since start",
            labels,
            registry=r,
        )
        self.graph_steps = Counter("dsv4_engine_graph_steps", "steps replayed from a CUDA graph", labels, registry=r)
        self.burst_steps = Counter(
            "dsv4_engine_burst_steps",
            "steps of waiting prompts alone while streams were decoding (each such stream waited one step)",
            labels,
            registry=r,
        )
        self.eager_steps = Counter(
            "dsv4_engine_eager_steps", "steps run eagerly (no graph fits them, or no CUDA)", labels, registry=r
        )
        self.compiles = _gauge(
            "dsv4_kernel_compilations_after_ready",
            "Triton kernel compilations since the server "
            "said it was ready (0: every step shape was warmed at start-up)",
            labels,
            registry=r,
        )
        self.warmup = _gauge(
            "dsv4_warmup_seconds", "start-up time spent capturing CUDA graphs and compiling kernels", labels, registry=r
        )
        self.graphs = _gauge("dsv4_cuda_graphs", "CUDA graphs captured (one per step bucket)", labels, r)
        self._phases: dict[str, float] = {}
        self._spec = {"verify_steps": 0, "drafted": 0, "accepted": 0}
        self._spec_lengths: list[int] = []
        self.model = model_name
        self._seen = {
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "preemptions": 0,
            "prefix_hit_tokens": 0,
            "graph_steps": 0,
            "eager_steps": 0,
            "burst_steps": 0,
        }

    def on_ready(self, info: dict) -> None:
        """The engine's start-up report (`build_engine`'s info)."""
        if not self.engine_wide:
            return
        self.warmup.labels(self.model).set(info.get("warmup_s", 0.0))
        self.graphs.labels(self.model).set(info.get("graphs", 0))
        self.compiles.labels(self.model).set(0)

    def on_step(self, m: dict, outputs, seconds: float) -> None:
        """Called after each engine step with the engine's metrics (`Engine.metrics()`) and its outputs (those
        of this process's requests)."""
        lab = self.model
        for o in outputs:
            if o.finished and not o.request_id.startswith(WARMUP_PREFIX):
                self.requests.labels(lab, o.finish_reason or "unknown").inc()
        if not self.engine_wide:
            return
        self.running.labels(lab).set(m["running"])
        self.waiting.labels(lab).set(m["waiting"])
        self.cache_usage.labels(lab).set(m["cache_usage"])
        if seconds > 0:  # a step (0: only admissions / aborts)
            self.step.labels(lab).observe(seconds)
            # the engine's count, not these outputs': other HTTP processes may hold some of the step's requests
            generated = m["generated_tokens"] - self._seen["generated_tokens"]
            self.tokens_per_s.labels(lab).set(generated / seconds)
        for key, counter in (
            ("prompt_tokens", self.prompt_tokens),
            ("generated_tokens", self.generation_tokens),
            ("preemptions", self.preemptions),
            ("prefix_hit_tokens", self.prefix_hits),
            ("graph_steps", self.graph_steps),
            ("eager_steps", self.eager_steps),
            ("burst_steps", self.burst_steps),
        ):
            delta = m[key] - self._seen[key]
            if delta > 0:
                counter.labels(lab).inc(delta)
            self._seen[key] = m[key]
        if m.get("kernel_compiles_after_ready") is not None:
            self.compiles.labels(lab).set(m["kernel_compiles_after_ready"])
        for phase, total in m.get("step_seconds", {}).items():
            delta = total - self._phases.get(phase, 0.0)
            if delta > 0:
                self.phase.labels(lab, phase).inc(delta)
            self._phases[phase] = total
        spec = m.get("speculative", {})
        for key, counter in (
            ("verify_steps", self.spec_verifies),
            ("drafted", self.spec_drafted),
            ("accepted", self.spec_accepted),
        ):
            delta = spec.get(key, 0) - self._spec[key]
            if delta > 0:
                counter.labels(lab).inc(delta)
                self._spec[key] = spec[key]
        lengths = spec.get("verify_lengths", [])
        for n, total in enumerate(lengths):
            seen = self._spec_lengths[n] if n < len(self._spec_lengths) else 0
            for _ in range(total - seen):
                self.spec_lengths.labels(lab).observe(n)
        self._spec_lengths = list(lengths)
        if self._spec["drafted"]:
            self.spec_rate.labels(lab).set(self._spec["accepted"] / self._spec["drafted"])
            self.spec_per_step.labels(lab).set(1 + self._spec["accepted"] / self._spec["verify_steps"])

    def observe_first(self, queue: float, prefill: float) -> None:
        """A sequence's first output: its time in the engine's queue and its prompt's steps."""
        self.queue.labels(self.model).observe(queue)
        self.prefill.labels(self.model).observe(prefill)

    def observe_aborted(self, sequences: int) -> None:
        """Sequences that ended without finishing (their client went away, or the shutdown's grace ran out)."""
        self.requests.labels(self.model, "abort").inc(sequences)

    def observe_request(
        self, ttft: float | None, itls: list[float], total: float, transport: float | None = None
    ) -> None:
        if ttft is not None:
            self.ttft.labels(self.model).observe(ttft)
        if transport is not None:
            self.transport.labels(self.model).observe(transport)
        for v in itls:
            self.itl.labels(self.model).observe(v)
        self.e2e.labels(self.model).observe(total)

    def render(self) -> bytes:
        if self.multiprocess_dir:  # every process's files
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=self.multiprocess_dir)
            return generate_latest(registry)
        return generate_latest(self.registry)
