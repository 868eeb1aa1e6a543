import json
import subprocess
import sys

import pytest
import torch

from dsv4.checkpoint import load_pretrained
from dsv4.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_info_json_flash_and_pro_without_weights():
    for preset, total, active in (("flash", 284.33e9, 13.80e9), ("pro", 1573.0e9, 49.78e9)):
        res = _run("info", "--preset", preset, "--json")
        assert res.returncode == 0, res.stderr
        info = json.loads(res.stdout)
        assert abs(info["total_params"] / total - 1) < 0.005
        assert abs(info["active_params"] / active - 1) < 0.005
        assert info["kv_bytes_1m"] > info["kv_bytes_1m_fp8"] > 0


def test_user_errors_are_one_line_exit_2():
    res = _run("info", "--preset", "nope")
    assert res.returncode == 2 and res.stderr.strip().startswith("error: argument --preset: unknown preset")
    assert "Traceback" not in res.stderr
    res = _run("generate", "--preset", "tiny", "--prompt-ids", "1,x")
    assert res.returncode == 2 and "comma-separated integers" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: --device cuda is valid here")
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--preset", "tiny", "hi"],
        ["check", "teacher-forcing"],
        ["train", "--preset", "tiny", "--steps", "1"],
        ["check", "conformance"],
    ],
)
def test_device_cuda_without_cuda_is_one_line(argv, capsys):
    assert main(argv + ["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--device" in err and "CUDA" in err and len(err.splitlines()) == 1, err


def test_api_and_cli_share_the_defaults(capsys):
    from dsv4 import defaults
    from dsv4.cli import build_parser
    from dsv4.engine import generate
    from dsv4.loading import default_model_dir

    # the command line's defaults are "auto" (the best device present, and its dtype), stated in --help; on a
    # machine without a GPU they resolve to the Python API's own (cpu, fp32), so both give the same text
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert "(default: auto)" in help_text and "auto = the best device present" in help_text
    if defaults.best_device() != defaults.DEVICE:
        pytest.skip("a GPU is present: the command line's auto device is not the API's default")
    assert defaults.resolve_dtype("auto", defaults.best_device()) == defaults.default_dtype()
    model = load_pretrained(default_model_dir(), progress=False)
    assert model.embed.weight.dtype == defaults.default_dtype() and model.embed.weight.device.type == defaults.DEVICE
    ids = generate(model, [[0, 5, 7]], max_new_tokens=6, temperature=0.9, top_p=0.9, seed=3, stop_at_eos=False)[0]
    assert (
        main(
            [
                "generate",
                "--prompt-ids",
                "0,5,7",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0.9",
                "--top-p",
                "0.9",
                "--seed",
                "3",
                "--no-stop",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["ids"] == ids


def test_generate_json_is_deterministic(capsys):
    args = ["generate", "--preset", "tiny", "--prompt-ids", "0,5,7", "--max-new-tokens", "5", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args + ["--temperature", "0.9", "--top-p", "0.9", "--seed", "4"]) == 0
    sampled = json.loads(capsys.readouterr().out)
    assert main(args + ["--temperature", "0.9", "--top-p", "0.9", "--seed", "4"]) == 0
    assert json.loads(capsys.readouterr().out) == sampled
    assert len(first["ids"]) == 5 and first["prompt_ids"] == [0, 5, 7]


def test_teacher_forcing_cli_exit_code(capsys):
    assert main(["check", "teacher-forcing", "--preset", "tiny", "--seq-len", "140", "--batch", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and rep["max_rel_error"] < 1e-4 and rep["tokens"] == 140
    assert main(["check", "teacher-forcing", "--preset", "tiny", "--seq-len", "10", "--prefill", "11"]) == 2
    capsys.readouterr()
    # a sequence shorter than the default prefill of 7 prefills all but its last token
    assert main(["check", "teacher-forcing", "--preset", "tiny", "--seq-len", "5", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and rep["tokens"] == 5 and rep["prefill"] == 4


def test_shipped_model_is_the_default_and_generates_text(capsys):
    from dsv4.loading import default_model_dir

    shipped = default_model_dir()
    assert shipped is not None and (shipped / "tokenizer.json").exists()
    assert main(["generate", "def fibonacci(n):", "--max-new-tokens", "12", "--no-stop", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == str(shipped) and len(out["ids"]) == 12
    assert out["text"] and out["prompt_ids"][0] == 0  # BOS, then the encoded prompt
