"""The launch spec of an engine (`dsv4.serve.startup.EngineSpec`): what a command line says, typed once,
the same after the spawn into an engine process or a worker, and refused in one line before any weights
are read when the model cannot run it."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle

import pytest

from dsv4.cli import build_parser
from dsv4.engine import EngineConfig
from dsv4.errors import UserError
from dsv4.loading import ModelSource, resolve_config
from dsv4.serve.startup import EngineSpec, check_engine_options

SERVE = [
    "serve",
    "--preset",
    "tiny",
    "--served-model-name",
    "mine",
    "--device",
    "cpu",
    "--dtype",
    "fp32",
    "--quant-mode",
    "int8",
    "--keep-quantized",
    "--max-num-seqs",
    "5",
    "--max-model-len",
    "300",
    "--max-batch-tokens",
    "40",
    "--page-size",
    "16",
    "--cache-pages",
    "9",
    "--no-prefix-caching",
    "--deterministic",
    "--no-cuda-graph",
    "--speculative",
    "2",
    "--threads",
    "3",
    "--tensor-parallel-size",
    "2",
    "--worker-timeout",
    "12.5",
    "--api-key",
    "k",
]


def parse(argv: list[str]):
    return build_parser(argv).parse_args(argv)


def test_serve_options_become_the_spec_fields():
    spec = EngineSpec.from_args(parse(SERVE), detokenize=False)
    assert spec == EngineSpec(
        source=ModelSource(preset="tiny", device="cpu", dtype="fp32", quant_mode="int8", keep_quantized=True),
        served_model_name="mine",
        max_num_seqs=5,
        max_model_len=300,
        max_batch_tokens=40,
        page_size=16,
        cache_pages=9,
        prefix_caching=False,
        deterministic=True,
        cuda_graphs=False,
        speculative=2,
        speculative_threshold=0.0,
        detokenize=False,
        threads=3,
        tensor_parallel_size=2,
        worker_timeout=12.5,
    )
    assert spec.served_name == "mine"
    assert dataclasses.replace(spec, served_model_name=None).served_name == "tiny"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_num_seqs = 6


def test_a_command_without_engine_options_gets_the_defaults():
    """`dsv4 generate` has no --max-num-seqs, --page-size, ...: the spec takes the engine's defaults, the
    command's own options, and the changes it asks for."""
    args = parse(["generate", "--preset", "tiny", "--speculative", "1", "hi"])
    spec = EngineSpec.from_args(args, max_num_seqs=1, prefix_caching=False)
    default = EngineSpec()
    assert (spec.max_num_seqs, spec.prefix_caching, spec.speculative) == (1, False, 1)
    for f in (
        "max_model_len",
        "max_batch_tokens",
        "page_size",
        "cache_pages",
        "tensor_parallel_size",
        "worker_timeout",
        "deterministic",
        "cuda_graphs",
    ):
        assert getattr(spec, f) == getattr(default, f), f
    assert default.worker_timeout == build_parser(["serve"]).parse_args(["serve"]).worker_timeout


def test_the_engine_config_is_the_specs():
    spec = EngineSpec.from_args(parse(SERVE))
    config = spec.engine_config()
    assert config == EngineConfig(
        max_seqs=5,
        max_model_len=300,
        max_batch_tokens=40,
        page_size=16,
        cache_pages=9,
        prefix_caching=False,
        deterministic=True,
        cuda_graphs=False,
        speculative=2,
        speculative_threshold=0.0,
    )
    assert EngineSpec().engine_config().max_seqs == EngineConfig().max_seqs  # no --max-num-seqs: the engine's


def _fields(spec: EngineSpec, queue) -> None:
    queue.put(dataclasses.asdict(spec))


def test_the_spec_crosses_a_spawn_unchanged():
    spec = EngineSpec.from_args(parse(SERVE), detokenize=False)
    assert pickle.loads(pickle.dumps(spec)) == spec
    ctx = mp.get_context("spawn")  # as the engine process and the workers are started
    queue = ctx.Queue()
    p = ctx.Process(target=_fields, args=(spec, queue))
    p.start()
    got = queue.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0 and got == dataclasses.asdict(spec)


def test_resolved_names_the_device_and_dtype():
    spec = EngineSpec(ModelSource(preset="tiny", device="cpu", dtype="auto")).resolved()
    assert (spec.source.device, spec.source.dtype) == ("cpu", "fp32")  # auto on a CPU: fp32
    assert spec.resolved() == spec
    assert spec.on_device("cpu").source == spec.source


@pytest.mark.parametrize(
    "change,words",
    [
        ({"max_model_len": 10**6}, "--max-model-len must be in [2, "),
        ({"max_num_seqs": 0}, "--max-num-seqs must be >= 1"),
        ({"max_batch_tokens": 0}, "--max-batch-tokens must be >= 1"),
        ({"speculative_threshold": 0.5}, "--speculative-threshold"),
    ],
)
def test_options_the_model_cannot_run_are_refused_in_one_line(change, words):
    spec = dataclasses.replace(EngineSpec.from_args(parse(["serve", "--preset", "tiny"])), **change)
    with pytest.raises(UserError) as e:
        check_engine_options(spec, resolve_config(spec.source))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_serve_refuses_before_the_engine_process_starts(monkeypatch):
    from dsv4.engine import engine_process
    from dsv4.serve.cli import cmd_serve

    def never(*_a, **_k):
        raise AssertionError("the engine process was started")

    monkeypatch.setattr(engine_process, "EngineProcess", never)
    args = parse(["serve", "--preset", "tiny", "--port", "0", "--device", "cpu", "--max-model-len", "999999"])
    with pytest.raises(UserError, match=r"^--max-model-len must be in \[2, \d+\] \(the model's context\)$"):
        cmd_serve(args)
