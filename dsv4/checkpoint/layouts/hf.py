"""The Hugging Face transformers layout: `save_pretrained` of `DeepseekV4ForCausalLM`.

Module names such as `self_attn.q_a_proj`, `attn_hc.fn`, `self_attn.sinks`,
`compressor.position_bias` (the name tables live in `names`: reading maps them to official names with
`canonical`, writing back with `hf_name`), routed experts fused per layer into `mlp.experts.gate_up_proj`
[E, 2*inter, dim] = cat(w1, w3) and `mlp.experts.down_proj` [E, dim, inter], everything BF16, the hash
table int64, no MTP block. Its config means transformers' semantics: no QAT simulation.

The config.json keys are translated beside it, in `hf_config.py` (`read_config`, `read_config_file`,
`to_hf_json`): the layout imports the config, the config knows no Hugging Face key.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import ModelConfig
from ..names import EXPERT, F32, HF_MARKERS, INT, Spec, hf_name, official_tensors
from ..safetensors_io import CheckpointError
from ..storage import ShardedWriter, Value
from .base import Layout, LayoutWriter, register


@register
class HFLayout(Layout):
    name = "hf"
    description = "transformers save_pretrained (HF module names, fused experts, BF16, no MTP)"
    priority = 10
    semantics = {"fp8_kv_sim": False, "fp4_indexer_sim": False}  # transformers simulates no QAT

    def claims(self, stored_names: list[str]) -> bool:
        return any(m in n for n in stored_names for m in HF_MARKERS)

    def expected(self, cfg: ModelConfig, mtp: bool = True) -> dict[str, tuple]:
        out: dict[str, tuple] = {}
        for name, spec in official_tensors(cfg, mtp=False).items():
            if spec.role == EXPERT:
                continue
            out[hf_name(name)] = (
                spec.shape,
                "F32" if spec.role == F32 else "I64" if spec.role == INT else "BF16",
            )
        for i in range(cfg.n_layers):
            e, inter, d = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ((e, 2 * inter, d), "BF16")
            out[f"model.layers.{i}.mlp.experts.down_proj"] = ((e, d, inter), "BF16")
        return out

    def mtp_absent(self, root: Path) -> str | None:
        return f"{root}: no MTP weights (transformers checkpoints carry none); MTP disabled"

    def write_tensors(self, cfg: ModelConfig) -> dict[str, Spec]:
        return official_tensors(cfg, mtp=False)

    def skips(self, official: str) -> bool:
        return official.startswith("mtp.")

    def writer(
        self, root: Path, cfg: ModelConfig, mp: int, fmt: str, expert_dtype: str | None, shard_bytes: int
    ) -> LayoutWriter:
        return HFWriter(root, cfg, shard_bytes)

    def verify_config(self, cfg: ModelConfig) -> ModelConfig | None:
        return None  # re-read with its own config.json and the layout's semantics

    @staticmethod
    def to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A dsv4 model state dict (stacked experts) -> transformers parameters (main model, no MTP)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            if name.startswith("mtp."):
                continue
            if ".ffn.experts.w" in name:
                prefix, w = name.rsplit(".", 1)
                hp = hf_name(prefix + ".x").rsplit(".", 1)[0]
                if w == "w1":
                    out[f"{hp}.gate_up_proj"] = torch.cat([t, state_dict[f"{prefix}.w3"]], 1)
                elif w == "w2":
                    out[f"{hp}.down_proj"] = t
                continue
            out[hf_name(name)] = t.long() if name.endswith("tid2eid") else t
        return out


class HFWriter(LayoutWriter):
    """BF16 tensors under transformers names; a layer's experts are buffered until all have come, then
    written fused."""

    def __init__(self, root: Path, cfg: ModelConfig, shard_bytes: int) -> None:
        self.out = ShardedWriter(root, shard_bytes)
        self.n_experts = cfg.n_routed_experts
        self.fused: dict[str, dict[tuple[int, str], torch.Tensor]] = {}

    def add(self, name: str, spec: Spec, v: Value) -> None:
        if spec.role == EXPERT:
            head, j, w, _ = name.rsplit(".", 3)
            buf = self.fused.setdefault(head, {})
            buf[(int(j), w)] = v.dequantize(torch.bfloat16)
            if len(buf) == 3 * self.n_experts:
                e = self.n_experts
                gate_up = torch.stack([torch.cat([buf[(k, "w1")], buf[(k, "w3")]], 0) for k in range(e)])
                down = torch.stack([buf[(k, "w2")] for k in range(e)])
                hp = hf_name(head + ".x").rsplit(".", 1)[0]
                self.out.add(f"{hp}.gate_up_proj", gate_up)
                self.out.add(f"{hp}.down_proj", down)
                del self.fused[head]
            return
        if spec.role == INT:
            self.out.add(hf_name(name), v.data.long())  # transformers: an int64 table
        elif spec.role == F32:
            self.out.add(hf_name(name), v.dequantize(torch.float32))
        else:
            self.out.add(hf_name(name), v.dequantize(torch.bfloat16))

    def close(self) -> dict[str, dict[str, str]]:
        if self.fused:
            raise CheckpointError(f"source is missing tensor '{next(iter(self.fused))}'")
        return self.out.close()
