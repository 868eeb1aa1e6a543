"""A corruption fuzzer: seeded random mutations of a small real checkpoint (FP8 + E8M0 + MXFP4, three
shards and an index) and of its config. Every case must, within a time bound, either load a model equal
to the original (except in the tensors whose payload bytes were changed, which must still be finite) or
raise CheckpointError with a one-line message - never another exception, never a hang. `inspect`, which
reads headers only, must likewise report or raise CheckpointError, and call a checkpoint ok whenever it
loads.

Cases: `pytest --fuzz-cases N` or DSV4_FUZZ_CASES=N (default 300, about 3 s); the first seed:
DSV4_FUZZ_SEED. A failure names the case's seed and mutations, and `DSV4_FUZZ_CASES=1
DSV4_FUZZ_SEED=<seed>` replays that case alone.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import struct
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_checkpoint_helpers import make_representable

from dsv4.checkpoint import CheckpointError, load_pretrained, model_values, save, to_model
from dsv4.checkpoint.inspect import inspect_dir
from dsv4.checkpoint.safetensors_io import read_header
from dsv4.config import ModelConfig

CASES = int(os.environ.get("DSV4_FUZZ_CASES", "300"))
SEED = int(os.environ.get("DSV4_FUZZ_SEED", "16"))
CASE_SECONDS = 20.0  # a case loads a 0.2M-parameter model in ~30 ms; 20 s only catches hangs


def micro_config() -> ModelConfig:
    """Every storage format and feature of the release (FP8 linears, MXFP4 experts, a hash layer with
    its tid2eid table, a compressed layer with the indexer) at 0.2M parameters."""
    return ModelConfig(
        name="micro",
        vocab_size=256,
        dim=64,
        n_layers=2,
        n_mtp_layers=0,
        n_hash_layers=1,
        n_heads=2,
        head_dim=128,
        rope_head_dim=64,
        q_lora_rank=32,
        o_groups=1,
        o_lora_rank=32,
        window_size=16,
        compress_ratios=(0, 4),
        index_n_heads=2,
        index_head_dim=64,
        index_topk=4,
        n_routed_experts=4,
        n_shared_experts=1,
        n_activated_experts=2,
        moe_inter_dim=32,
        max_seq_len=256,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from dsv4.model import DeepSeekV4

    cfg = micro_config()
    m = make_representable(DeepSeekV4.from_config(cfg, seed=3, dtype=torch.float32).eval(), "fp8", "fp4")
    root = tmp_path_factory.mktemp("fuzz")
    d = save(model_values(m), cfg, root / "ckpt", "fp8", expert_dtype="fp4", shard_bytes=200_000)
    assert len(list(d.glob("*.safetensors"))) >= 2 and (d / "model.safetensors.index.json").exists()
    outside = root / "outside"
    outside.mkdir()
    ref = {k: v.clone() for k, v in load_pretrained(d, dtype=torch.float32, progress=False).state_dict().items()}
    assert all(torch.equal(ref[k], v) for k, v in m.state_dict().items())
    return d, ref, outside


class Timeout(BaseException):
    """Raised by the alarm; a BaseException so that no `except Exception` in the code under test eats it."""


@contextmanager
def time_bound(seconds: float):
    def alarm(signum, frame):
        raise Timeout(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------ mutations
HOSTILE_VALUES = [
    None,
    True,
    False,
    "x",
    "",
    [],
    [1, 2],
    {},
    {"a": 1},
    0,
    -1,
    1,
    2**31,
    10**30,
    -(10**30),
    0.5,
    -0.0,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e-320,
]


def _pristine(outside: Path) -> Path:
    """An untouched copy of the checkpoint (the fixture's directory, beside `outside`)."""
    return outside.parent / "ckpt"


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def _split(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(f: Path, header: dict, payload: bytes) -> None:
    hb = json.dumps(header, separators=(",", ":")).encode()
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + payload)


def _official(stored: str) -> str:
    """A stored tensor name -> the official weight name whose values it determines (scales: the weight)."""
    return stored[: -len(".scale")] + ".weight" if stored.endswith(".scale") else stored


def mut_header_bytes(d, rng, outside, touched):
    f = rng.choice(_shards(d))
    raw = bytearray(f.read_bytes())
    if len(raw) < 8 or not 0 < struct.unpack("<Q", raw[:8])[0] <= len(raw) - 8:
        return f"{f.name} already broken"
    (n,) = struct.unpack("<Q", raw[:8])
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(8, 8 + n)
        raw[i] = rng.choice([rng.randrange(256), ord(rng.choice('0123456789",:[]{}- eE.'))])
    f.write_bytes(bytes(raw))
    return f"header bytes of {f.name}"


def mut_header_length(d, rng, outside, touched):
    f = rng.choice(_shards(d))
    raw = bytearray(f.read_bytes())
    if len(raw) < 8:
        return f"{f.name} already broken"
    (n,) = struct.unpack("<Q", raw[:8])
    new = rng.choice([0, 1, n - 1, n + 1, n + 8, 2**63, 2**64 - 1, len(raw), rng.randrange(2**64)])
    raw[:8] = struct.pack("<Q", new % 2**64)
    f.write_bytes(bytes(raw))
    return f"header length of {f.name} -> {new}"


def mut_payload_bytes(d, rng, outside, touched):
    f = rng.choice(_shards(d))
    try:
        infos, _ = read_header(f)
    except CheckpointError:
        return f"{f.name} already broken"
    raw = bytearray(f.read_bytes())
    start = min((i.begin for i in infos.values()), default=len(raw))
    if start >= len(raw):
        return f"{f.name} has no payload"
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(start, len(raw))
        raw[i] = rng.choice([rng.randrange(256), 0xFF, 0xFE, 0x7F, 0x00, raw[i] ^ (1 << rng.randrange(8))])
        touched.update(_official(t.name) for t in infos.values() if t.begin <= i < t.end)
    f.write_bytes(bytes(raw))
    return f"payload bytes of {f.name}"


def mut_truncate(d, rng, outside, touched):
    f = rng.choice(_shards(d))
    raw = f.read_bytes()
    f.write_bytes(raw[: rng.randrange(max(len(raw), 1))])
    return f"truncated {f.name}"


def mut_append(d, rng, outside, touched):
    f = rng.choice(_shards(d))
    with open(f, "ab") as out:
        out.write(bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))))
    return f"appended bytes to {f.name}"


def mut_header_json(d, rng, outside, touched):
    f = rng.choice(_shards(d))
    try:
        header, payload = _split(f)
        names = [k for k in header if k != "__metadata__" and isinstance(header[k], dict)]
        name = rng.choice(names)
        ent = header[name]
        ent["shape"], ent["data_offsets"]
    except (ValueError, IndexError, KeyError, TypeError, struct.error, RecursionError):
        return f"{f.name} already broken"
    op = rng.randrange(9)
    if op == 0:
        ent["dtype"] = rng.choice(
            ["F32", "BF16", "F16", "I8", "U8", "I32", "I64", "F8_E4M3", "F8_E8M0", "F4", "BOOL", "F64", "X9", 7, None]
        )
    elif op == 1:
        shape = list(ent["shape"]) or [1]
        k = rng.randrange(len(shape))
        shape[k] = rng.choice([0, 1, shape[k] + 1, shape[k] - 1, shape[k] * 2, -shape[k], 2**40, "4", 1.5])
        ent["shape"] = rng.choice([shape, shape[::-1], shape + [1], [math.prod(ent["shape"])]])
    elif op == 2:
        b, e = ent["data_offsets"]
        ent["data_offsets"] = rng.choice(
            [[b + 1, e + 1], [b, e + 8], [e, b], [-8, e - b - 8], [b], [b, e, e], [0, e - b], "0", [b, 1e3]]
        )
    elif op == 3:
        del header[name]
    elif op == 4:  # another tensor's name: a duplicate, or two tensors swapped (then both may differ)
        other = rng.choice(names)
        header[name], header[other] = header[other], header[name]
        touched.update({_official(name), _official(other)})
    elif op == 5:
        header[name + rng.choice(["x", ".weight", "_"])] = header.pop(name)
    elif op == 6:
        header["__metadata__"] = rng.choice([{"format": "pt", "k": "v"}, [], "x", {"a": 1}, None])
    elif op == 7:
        header[name] = rng.choice(HOSTILE_VALUES)
    else:
        header["layers.9.attn.bogus.weight"] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    _join(f, header, payload)
    return f"header entry of '{name}' in {f.name} (edit {op})"


def mut_index(d, rng, outside, touched):
    idx = d / "model.safetensors.index.json"
    try:
        obj = json.loads(idx.read_text())
        if not all(isinstance(v, str) for v in obj["weight_map"].values()) or not obj["weight_map"]:
            raise TypeError("not a weight map")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return "index already broken"
    wm = obj["weight_map"]
    key = rng.choice(sorted(wm))
    shards = sorted(set(wm.values()))
    op = rng.randrange(8)
    if op == 0:
        target = outside / "stolen.safetensors"
        shutil.copyfile(sorted(_pristine(outside).glob("*.safetensors"))[0], target)
        wm[key] = rng.choice([f"../{outside.name}/stolen.safetensors", str(target)])
        for k, v in list(wm.items()):
            if v == shards[0]:
                wm[k] = wm[key]
    elif op == 1:
        wm[key] = rng.choice(
            [
                "../../../../etc/passwd",
                "/etc/passwd",
                "/dev/zero",
                "nope.safetensors",
                "sub/../" + wm[key],
                "",
                ".",
                "config.json",
            ]
        )
    elif op == 2:
        wm[key] = rng.choice(HOSTILE_VALUES)
    elif op == 3:
        obj["weight_map"] = rng.choice(HOSTILE_VALUES)
    elif op == 4:
        del obj["weight_map"]
    elif op == 5:
        wm[key] = rng.choice(shards)  # the index may be wrong about where a tensor is: only files count
    elif op == 6:
        idx.write_bytes(idx.read_bytes()[: rng.randrange(max(idx.stat().st_size, 1))])
        return "truncated the index"
    else:
        idx.write_text(rng.choice(["[]", "null", "1", '"x"', "[" * 100000, '{"weight_map": ' + "[" * 5000]))
        return "index not an object"
    idx.write_text(json.dumps(obj))
    return f"index edit {op} at '{key}'"


def _config_paths(obj, prefix=()):
    for k, v in obj.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from _config_paths(v, (*prefix, k))


def mut_config(d, rng, outside, touched):
    path = d / "config.json"
    try:
        obj = json.loads(path.read_text())
        obj.items()
    except (ValueError, AttributeError, RecursionError):
        return "config already broken"
    keys = list(_config_paths(obj))
    op = rng.randrange(5)
    if op == 3:
        path.write_bytes(path.read_bytes()[: rng.randrange(max(path.stat().st_size, 1))])
        return "truncated config.json"
    if op == 4:
        path.write_bytes(rng.choice([b"\xff\xfe{}", b"[]", b"null", b"[" * 100000, b'{"dim": 1' + b"0" * 5000 + b"}"]))
        return "config.json not a config object"
    key = rng.choice(keys)
    parent = obj
    for k in key[:-1]:
        parent = parent[k]
    old = parent[key[-1]]
    if op == 0:
        parent[key[-1]] = rng.choice(HOSTILE_VALUES)
    elif op == 1 and isinstance(old, (int, float)) and not isinstance(old, bool):
        parent[key[-1]] = rng.choice([old * 2, old + 1, old - 1, -old, old * 1000, old / 3, 0])
    elif op == 2:
        del parent[key[-1]]
    else:
        parent[key[-1]] = rng.choice(HOSTILE_VALUES)
    path.write_text(json.dumps(obj))  # NaN / Infinity as Python's json writes them
    return f"config key {'.'.join(key)}: {old!r} -> {parent.get(key[-1], '<deleted>')!r}"


def mut_file_type(d, rng, outside, touched):
    victim = rng.choice([*_shards(d), d / "model.safetensors.index.json", d / "config.json"])
    if not (_pristine(outside) / victim.name).exists():
        return "no file to swap"
    victim.unlink(missing_ok=True)
    kind = rng.randrange(6)
    if kind == 0:
        os.mkfifo(victim)
    elif kind == 1:
        victim.mkdir()
    elif kind == 2:
        os.symlink(victim.name, victim)  # a loop
    elif kind == 3:
        os.symlink(outside / "missing", victim)  # dangling
    elif kind == 4:
        os.symlink("/dev/zero", victim)
    else:  # a valid file, but outside the checkpoint
        shutil.copyfile(_pristine(outside) / victim.name, outside / victim.name)
        os.symlink(outside / victim.name, victim)
    return f"{victim.name} replaced by file type {kind}"


MUTATIONS: list[Callable] = [
    mut_header_bytes,
    mut_header_length,
    mut_payload_bytes,
    mut_truncate,
    mut_append,
    mut_header_json,
    mut_index,
    mut_config,
    mut_file_type,
]


# ------------------------------------------------------------------------------------------ the fuzzer
def run_case(base_dir: Path, ref: dict, outside: Path, work: Path, seed: int) -> str:
    rng = random.Random(seed)
    d = work / f"case{seed}"
    shutil.copytree(base_dir, d)
    touched: set[str] = set()
    what = [f"seed {seed}"]
    chosen = [rng.choice(MUTATIONS) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    # file-type swaps last and once: the other mutations read and rewrite regular files
    chosen = [m for m in chosen if m is not mut_file_type] + [mut_file_type] * (mut_file_type in chosen)
    for mutate in chosen:
        what.append(mutate(d, rng, outside, touched))
    what = "; ".join(what)
    try:
        with time_bound(CASE_SECONDS):
            model = load_pretrained(d, dtype=torch.float32, progress=False)
    except CheckpointError as e:
        assert "\n" not in str(e), f"{what}: multi-line error {str(e)!r}"
        model = None
    except Timeout:
        pytest.fail(f"{what}: load did not answer within {CASE_SECONDS} s")
    except Exception as e:  # noqa: BLE001 - the property under test: nothing but CheckpointError
        pytest.fail(f"{what}: load raised {type(e).__name__}: {e}")
    try:
        with time_bound(CASE_SECONDS):
            report = inspect_dir(d)
    except CheckpointError:
        report = None
    except Timeout:
        pytest.fail(f"{what}: inspect did not answer within {CASE_SECONDS} s")
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{what}: inspect raised {type(e).__name__}: {e}")
    shutil.rmtree(d, ignore_errors=True)
    if model is None:
        return "refused"
    assert report is not None and report["ok"], f"{what}: loads, but inspect reports {report}"
    sd = model.state_dict()
    assert set(sd) == set(ref), f"{what}: loaded a model with other tensors"
    allowed = {to_model(n)[0] for n in touched}
    for k, want in ref.items():
        got = sd[k]
        if k in allowed:
            assert got.shape == want.shape, f"{what}: {k} changed shape"
            if got.is_floating_point():
                assert bool(torch.isfinite(got).all()), f"{what}: {k} loaded with non-finite values"
        else:
            assert torch.equal(got, want), f"{what}: {k} differs from the original, but its bytes were not changed"
    return "same" if not allowed else "payload changed"


def test_corruption_fuzzer(base, tmp_path, request):
    d, ref, outside = base
    cases = request.config.getoption("--fuzz-cases") or CASES
    outcomes: dict[str, int] = {}
    for seed in range(SEED, SEED + cases):
        r = run_case(d, ref, outside, tmp_path, seed)
        outcomes[r] = outcomes.get(r, 0) + 1
    print(f"fuzz outcomes over {cases} cases from seed {SEED}: {outcomes}")
    assert sum(outcomes.values()) == cases
    if cases >= 100:  # the mutations reach both outcomes: the fuzzer is not refusing everything blindly
        assert (
            outcomes.get("refused", 0) > cases // 4 and outcomes.get("same", 0) + outcomes.get("payload changed", 0) > 0
        ), outcomes
