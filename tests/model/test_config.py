import json
from pathlib import Path

import pytest

from dsv4.checkpoint import read_config, to_hf_json
from dsv4.config import ConfigError, ModelConfig
from dsv4.info import model_info

# the released DeepSeek-V4-Pro config.json (Hugging Face keys) and inference/config.json, verbatim
REF = Path(__file__).resolve().parents[1] / "data" / "deepseek-v4-pro"


def _ref(name: str) -> dict:
    return json.loads((REF / name).read_text())


def test_pro_preset_equals_both_released_configs():
    assert read_config(_ref("config.json")) == ModelConfig.preset("pro")
    assert ModelConfig.from_dict(_ref("inference-config.json")) == ModelConfig.preset("pro")


def test_hf_and_inference_round_trip():
    for name in ("tiny", "small", "medium", "flash", "pro"):
        cfg = ModelConfig.preset(name)
        assert read_config(to_hf_json(cfg)) == cfg
        assert ModelConfig.from_dict(cfg.to_inference_json()) == cfg


def test_medium_preset_trains_on_one_h200(capsys):
    """`medium` (config and meta-device counts only: nothing allocated) sits between small and flash, has
    3-8B parameters with a realistic expert count, and by `dsv4 info`'s estimate trains 1 x 4096 tokens on
    one 141 GB GPU with activation checkpointing (fp32 master weights, gradients, Muon + AdamW state)."""
    from dsv4.cli import main

    assert main(["info", "--preset", "medium", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "medium" and 3e9 <= info["total_params"] <= 8e9
    cfg = ModelConfig.preset("medium")
    assert cfg.n_routed_experts >= 64 and cfg.n_activated_experts >= 6 and cfg.max_seq_len >= 4096
    assert ModelConfig.preset("small").dim < cfg.dim < ModelConfig.preset("flash").dim
    mem = info["memory"]
    assert mem["settings"]["train_seq_len"] == 4096 and mem["train_gpus_ckpt"] == 1, mem["settings"]


def test_hf_layer_types_and_mlp_layer_types():
    raw = to_hf_json(ModelConfig.preset("small"))
    raw.pop("mlp_layer_types")
    raw["num_hash_layers"] = 2
    cfg = read_config(raw)
    assert cfg.compress_ratios == (0, 4, 128, 4, 128, 4, 128, 4) and cfg.n_hash_layers == 2


@pytest.mark.parametrize(
    "change, key",
    [
        ({"hidden_sizee": 5}, "hidden_sizee"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ({"mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 6}, "mlp_layer_types"),
        ({"num_hash_layers": 3}, "mlp_layer_types"),
        ({"scoring_func": "relu"}, "score_func"),
        ({"o_groups": 3}, "o_groups"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
    ],
)
def test_hf_bad_values_name_the_key(change, key):
    raw = to_hf_json(ModelConfig.preset("small"))
    raw.update(change)
    with pytest.raises(ConfigError, match=key):
        read_config(raw)


def test_inference_unknown_key_and_bad_ratio_count():
    raw = ModelConfig.preset("tiny").to_inference_json()
    with pytest.raises(ConfigError, match="'dimm'"):
        ModelConfig.from_dict({**raw, "dimm": 3})
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelConfig.from_dict({**raw, "compress_ratios": [0, 4], "n_mtp_layers": 1})


def test_parameter_counts_flash_pro_small_tiny():
    flash, pro = model_info(ModelConfig.preset("flash")), model_info(ModelConfig.preset("pro"))
    assert abs(flash.total_params / 284.33e9 - 1) < 0.005
    assert abs(flash.active_params / 13.80e9 - 1) < 0.005
    assert abs(pro.total_params / 1573.0e9 - 1) < 0.005
    assert abs(pro.active_params / 49.78e9 - 1) < 0.005
    assert abs(flash.mtp_params / 6.61e9 - 1) < 0.005
    small = model_info(ModelConfig.preset("small"))
    assert 0.55e9 < small.total_params < 0.59e9 and small.mtp_params == 0
    tiny = ModelConfig.preset("tiny")
    assert model_info(tiny).total_params + model_info(tiny).mtp_params < 5e6
    # tiny exercises every feature
    assert {0, 4, 128} <= set(tiny.compress_ratios) and tiny.n_hash_layers >= 1 and tiny.n_mtp_layers >= 1


def test_parameter_count_matches_a_real_model():
    from dsv4 import DeepSeekV4

    cfg = ModelConfig.preset("tiny")
    info = model_info(cfg)
    model = DeepSeekV4(cfg)
    assert sum(p.numel() for p in model.parameters()) == info.total_params + info.mtp_params


def test_the_config_knows_no_hugging_face_key_and_says_where_they_are_read():
    """ModelConfig reads its own fields and the official inference keys; a Hugging Face config is the hf
    layout's to translate (`dsv4.checkpoint.read_config`), and from_dict says so in one line."""
    raw = to_hf_json(ModelConfig.preset("tiny"))
    with pytest.raises(ConfigError, match="dsv4.checkpoint.read_config"):
        ModelConfig.from_dict(raw)
    assert read_config(raw) == ModelConfig.preset("tiny")
