"""Golden references from the official DeepSeek-V4 inference code: conformance that is not self-comparison.

`dsv4/assets/goldens/<case>/` holds what the official `inference/model.py` computed (with the original
kernels' rounding in the QAT round trips; `scripts/official_goldens.py` regenerates them and names the
commit): `config.json` (inference keys), `model0-mp1.safetensors` (weights in the official inference
layout) and `golden.safetensors` (input tokens, each layer's attention and MoE output for every position,
and the last position's logits). Cases: "bf16" (BF16 weights) and "fp8-fp4" (FP8 weights with UE8M0
scales, MXFP4 experts, W8A8). Both: a hash-routed window-only layer, a CSA layer with the Lightning
Indexer and an HCA layer, MoE with a shared expert, mHC, 132 tokens (window 16, one HCA entry).
"mtp": the multi-token-prediction block, which the official forward does not run: one hash-routed
window-only layer and one MTP block (BF16), the official `MTPBlock.forward` called on the main model's
last hidden state at positions 0..130 with tokens 1..131; its attention and MoE outputs ("mtp.0.*") and
its last-position logits against dsv4's `forward(mtp=True)` (measured: within 2e-6).

The implementation under test loads the weights through its own checkpoint loader and runs the same
tokens; every stage is compared with the official numbers, so a bug in the model *or* in the reference
ops it shares with every other check shows up here.

Tolerances, as a fraction of the stage's largest magnitude: both sides compute in fp32 and differ only in
summation order: a few ulp (2^-23 = 1.2e-7) per reduction, through a dozen reductions per layer (norms,
projections of up to 1024 terms, softmaxes, Sinkhorn) over three layers: 4e-5, about 300 ulp (the bf16
case agrees to 1e-6 - 7e-6 here).
In the fp8-fp4 case every linear quantizes its input to E4M3 per
block of 128: once two fp32 summation orders put an activation on either side of an E4M3 rounding
midpoint, that element moves by one E4M3 step (2^-3 of its magnitude) and the change propagates; layer 0
(whose inputs are bit-identical) is held to 4e-5 and the later stages to 2^-4.

`dsv4/assets/goldens/transformers/` holds the same kind of fixture from Hugging Face transformers'
`DeepseekV4ForCausalLM` (`scripts/transformers_goldens.py`; the transformers version is in the golden
file's metadata): `checkpoint/` in transformers' checkpoint layout (its `save_pretrained`: config keys of
`DeepseekV4Config`, release tensor names under `model.`) and `golden.safetensors` (tokens, every layer's
attention and MoE output, last-position logits), all computed in fp32. transformers simulates no QAT (no
FP8 KV or FP4 indexer round trip, no indexer rotation) and builds no MTP block; dsv4's loader takes a
transformers directory in those semantics, so everything the fixture holds is expected to match, with
the fp32 tolerance above (measured: 5e-7 - 3e-6).

`dsv4/assets/goldens/dspark/` holds the DSpark draft of Flash-0731 (`scripts/dspark_goldens.py`): two
window-only main layers and a two-stage draft in the official inference layout, computed with the official
code's blocks (the draft's attention, taps and heads as the release defines them, written in the official
primitives) and DeepSpec's Markov head, confidence head and per-position verify length; 40 tokens, five
anchors whose context windows are partly and wholly filled (`compare_dspark`; measured: within 1.4e-5 at
every stage on the CPU, the same drafts and verify lengths). The draft's context keys pass through the
FP8 round trip of the KV (QAT), so, as in the fp8-fp4 case, an fp32 difference of an ulp in its input
(another device's summation order) can move a key element by a whole E4M3 step: on CUDA a 3.8e-6
difference before that round trip became 8.9e-3 after it and 7.5e-4 in the base logits. The draft's
stages (`mtp.*`, `dspark.*`) are therefore held to 2^-4, the main model's taps and logits to 4e-5, and
the drafted tokens and verify lengths must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "assets" / "goldens"
CASES = ("bf16", "fp8-fp4", "mtp")
TRANSFORMERS_CASE = "transformers"
DSPARK_CASE = "dspark"
FP32_TOL = 4e-5
W8A8_TOL = 2.0**-4


@dataclass
class StageError:
    case: str
    stage: str
    error: float  # max |got - golden| / max |golden|
    tol: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tol


def tolerance(case: str, stage: str) -> float:
    if case != "fp8-fp4" or stage.startswith("layers.0."):
        return FP32_TOL
    return W8A8_TOL


def compare_case(case: str, device: str | torch.device = "cpu", model=None) -> list[StageError]:
    """Load the case's official-layout weights with the checkpoint loader (unless `model` is given), run
    its tokens on `device` with the default backends and compare every golden stage."""
    from safetensors.torch import load_file

    from ..checkpoint import load_pretrained
    from .capture import capture

    d = GOLDEN_DIR / case
    golden = load_file(str(d / "golden.safetensors"))
    if model is None:
        ckpt = d / "checkpoint" if case == TRANSFORMERS_CASE else d
        model = load_pretrained(ckpt, dtype=torch.float32, device=device)
    tokens = golden["tokens"].to(device)
    mtp = any(k.startswith("mtp.") for k in golden)
    with torch.no_grad():
        out, stages = capture(lambda: model(tokens, mtp=mtp))
    rows = []
    for name, want in golden.items():
        if name == "tokens":
            continue
        if name == "logits":
            got = out.logits[:, -1]
        elif name.startswith("mtp.") and name.endswith(".logits"):  # depth k: the last position
            got = out.mtp_logits[int(name.split(".")[1])][:, -1]
        elif name.startswith("mtp."):  # MTP block k records as layer n_layers + k
            k, rest = name.split(".", 2)[1:]
            got = stages[f"layers.{model.cfg.n_layers + int(k)}.{rest}"]
        else:
            got = stages[name]
        err = float((got.float().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30))
        rows.append(StageError(case, name, err, tolerance(case, name)))
    return rows


def compare_dspark(device: str | torch.device = "cpu", model=None) -> list[StageError]:
    """The DSpark fixture (`scripts/dspark_goldens.py`: the official code's blocks with Flash-0731's draft
    written out in them, DeepSpec's Markov and confidence heads and per-position verify length): load it
    with the checkpoint loader (unless `model` is given), run the draft over the fixture's anchors
    (`DSparkDraft.sequence_blocks`, greedy `chain`) and compare the taps, every stage's attention and MoE
    output, the base and Markov-corrected logits, the confidence logits (`dspark_tolerance`), the drafted
    tokens and the verify length at the fixture's threshold (equal: error 0, else inf)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ..checkpoint import load_pretrained
    from ..model.dspark import verify_length
    from .capture import capture

    d = GOLDEN_DIR / DSPARK_CASE
    golden = load_file(str(d / "golden.safetensors"))
    with safe_open(str(d / "golden.safetensors"), "pt") as f:
        threshold = float(f.metadata()["threshold"])
    if model is None:
        model = load_pretrained(d, dtype=torch.float32, device=device)
    dev = model.embed.weight.device
    tokens, anchors = golden["tokens"].to(dev), golden["anchors"].to(dev)
    n, B = model.cfg.n_layers, model.cfg.dspark_block_size
    with torch.no_grad():
        out = model(tokens, taps=True)

        def draft():
            blocks = model.dspark.sequence_blocks(out.taps, tokens, anchors)
            return model.dspark.chain(blocks, tokens[0, anchors[0]])

        prop, stages = capture(draft)
    got = {
        "logits": out.logits[:, -1],
        "taps": out.taps,
        "dspark.logits": prop.logits,
        "dspark.confidence": prop.confidence,
        "dspark.base_logits": stages[f"mtp.{model.cfg.n_mtp_layers - 1}.base_logits"].view(-1, B, model.cfg.vocab_size),
    }
    for k in range(model.cfg.n_mtp_layers):
        for part in ("attn.out", "ffn.out"):
            got[f"mtp.{k}.{part}"] = stages[f"layers.{n + k}.{part}"].view(-1, B, model.cfg.dim)
    rows = []
    for name, want in golden.items():
        if name in ("tokens", "anchors"):
            continue
        if name == "dspark.tokens":
            err = 0.0 if torch.equal(prop.tokens.cpu(), want) else float("inf")
        elif name == "dspark.verify_length":
            mine = verify_length(prop.confidence, threshold, rule="per_position").cpu()
            err = 0.0 if torch.equal(mine, want) else float("inf")
        else:
            err = float((got[name].float().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30))
        rows.append(StageError(DSPARK_CASE, name, err, dspark_tolerance(name)))
    return rows


def dspark_tolerance(stage: str) -> float:
    """The main model's stages: fp32; the draft's, downstream of its context keys' FP8 round trip: 2^-4."""
    return W8A8_TOL if stage.startswith(("mtp.", "dspark.")) else FP32_TOL


def fixture_metadata(case: str) -> dict[str, str]:
    """The metadata of a case's golden file (for transformers: the versions that computed it)."""
    from safetensors import safe_open

    with safe_open(str(GOLDEN_DIR / case / "golden.safetensors"), "pt") as f:
        return dict(f.metadata() or {})
