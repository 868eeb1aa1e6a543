"""The V4 training loop: data -> model -> losses -> Muon/AdamW -> bias balancing -> metrics/checkpoints.

`Trainer(TrainConfig(...)).fit()` runs a whole job; `dsv4 train` is a thin front end over it.
Under `torchrun` (WORLD_SIZE > 1) the model is sharded by `dsv4.train.distributed` (FSDP2 + expert
parallelism) and each process takes its rows of every global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .. import ops
from ..config import ModelConfig
from ..defaults import resolve_device
from ..errors import RunFailed, UserError, writing
from ..model.transformer import HEAD_PRECISIONS
from ..tokenizer import Tokenizer
from . import balance, checkpoint, clipping, data, metrics
from .casts import StepCasts
from .compiled import compile_blocks
from .dspark_loss import DSparkLossConfig, dspark_loss, sample_anchors
from .graphed import ReplayAfterFirst
from .losses import LossParts, total_loss
from .micro import MicroSums, routers_with_load
from .optim import MuonAdamW, OptimConfig, lr_factor, orthogonalization_error
from .settings import QUICK_CPU_DEFAULTS, STANDARD_DEFAULTS, TrainConfig, model_config_of  # noqa: F401  (TrainConfig: re-exported)
from .stops import nonfinite_stop


# ------------------------------------------------------------------------------------------ helpers
def _follow_latest(root: Path) -> Path:
    """The checkpoint that `root/latest` names (`checkpoint.follow_latest`: opened like any checkpoint file,
    and it must name a directory directly inside `root`)."""
    return checkpoint.follow_latest(root)


def _distributed_module():
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    try:
        from . import distributed
    except ImportError as e:
        raise UserError(f"launched with WORLD_SIZE>1 but dsv4.train.distributed is unavailable ({e})") from None
    return distributed


HISTORY_KEPT = 1000  # metric rows a checkpoint carries (metrics.jsonl keeps them all)


class Trainer:
    def __init__(self, cfg: TrainConfig, log=print):
        self.cfg = cfg
        self.log = log
        if cfg.device != "auto":  # one line, not a traceback, for a bad device
            resolve_device(cfg.device)
        if cfg.export and os.path.lexists(cfg.export):  # refused now, not after the whole run
            raise UserError(f"--export {cfg.export}: already exists; choose a new destination")
        if (cfg.stop_after_s or 0) < 0 or (cfg.time_budget_s or 0) < 0:
            raise UserError("--stop-after-s and --time-budget-s are seconds: not negative")
        if cfg.stop_after_s and cfg.save_every is not None and cfg.save_every < 0:
            raise UserError("--stop-after-s ends a stage with a checkpoint to resume from: not with --save-every -1")
        if not isinstance(cfg.grad_accum, int) or isinstance(cfg.grad_accum, bool) or cfg.grad_accum < 1:
            raise UserError(f"grad_accum must be a whole number of micro-batches >= 1, got {cfg.grad_accum!r}")
        if cfg.stop_after_s and cfg.time_budget_s:  # (each stage would shorten the schedule from its own speed)
            raise UserError("--stop-after-s with --time-budget-s: give the run's --steps instead")
        self.dist = _distributed_module()
        self.rank, self.world = 0, 1
        if self.dist is not None:
            dev = None if cfg.device == "auto" else cfg.device
            self.rank, self.world, _ = self.dist.setup_distributed(device=dev)
        self.device = self._pick_device()
        self.cfg = cfg = cfg.resolved(self.device.type)  # defaults that depend on preset and device
        if cfg.head_precision not in HEAD_PRECISIONS:
            raise UserError(f"--head-precision must be one of {', '.join(HEAD_PRECISIONS)}, got {cfg.head_precision!r}")
        prec = cfg.precision if cfg.precision != "auto" else ("bf16" if self.device.type == "cuda" else "fp32")
        if prec not in ("bf16", "fp32"):  # (refused before any data or model work)
            raise UserError(f"--precision must be auto, bf16 or fp32, got '{prec}'")
        self.precision = prec
        if cfg.head_precision == "bf16" and prec == "fp32":
            raise UserError(
                "--head-precision bf16 gives the heads bf16 products under bf16 autocast: it needs --precision "
                f"bf16 (this run computes in fp32{' (auto on a CPU)' if cfg.precision == 'auto' else ''})"
            )
        self._graph = self.casts = None  # (casts: the weights' bf16 forms kept for a step, `StepCasts`)
        self._micro = 0  # the micro-batch of the step being run (--grad-accum)
        self._gnorm_in: torch.Tensor | None = None  # the norm the update clips by (_update)
        if cfg.draft not in (None, "none", "mtp", "dspark"):
            raise UserError(f"--draft must be none, mtp or dspark, got {cfg.draft!r}")
        if cfg.cuda_graph:  # refused before any data or model work
            why = (
                "it needs a CUDA device"
                if self.device.type != "cuda"
                else "it does not train a DSpark draft (its anchors are drawn per step)"
                if cfg.draft == "dspark"
                else "it runs one process (use it without torchrun)"
                if self.world > 1
                else "it does not combine with --compile"
                if cfg.compile
                else None
            )
            if why:
                raise UserError(f"--cuda-graph: {why}")
        from ..defaults import set_threads

        set_threads(cfg.threads)
        self.out = Path(cfg.out)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        if cfg.deterministic:  # before any compilation
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            ops.set_deterministic(True)
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.seed)
        if cfg.init_from:  # a Hub id becomes its cache snapshot
            from ..checkpoint.hub import resolve_model_path

            self.cfg = cfg = dataclasses.replace(cfg, init_from=str(resolve_model_path(cfg.init_from)))
        self._build_data()
        self._build_model()
        self.opt = MuonAdamW(
            self.model, OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, muon_momentum=cfg.muon_momentum)
        )
        self.step = 0
        self.history: list[dict] = []
        self.jsonl = metrics.JsonlLog(
            self.out / "metrics.jsonl" if self.rank == 0 else None, append=cfg.resume is not None
        )
        if cfg.resume:
            self._resume(cfg.resume)
            dropped = self.jsonl.truncate_after(self.step)
            if dropped:
                self.log(f"metrics.jsonl: {dropped} rows after step {self.step} dropped (replayed from here)")
        if cfg.compile:
            compile_blocks(self.model, self.device)

    # ---------------------------------------------------------------- setup
    def _pick_device(self) -> torch.device:
        d = self.cfg.device
        if d == "auto":
            d = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(d)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return dev

    def _model_config(self) -> ModelConfig:
        c = self.cfg
        base = None
        if c.init_from:
            from ..checkpoint import plan

            # the config the loader would build (the layout's semantics, e.g. no MTP in an HF directory);
            # trained weights leave the FP8 / FP4 grid after the first step: a float model (W8A16 numerics)
            base = plan(c.init_from, overrides={"quant_mode": "w8a16"}).cfg
            self.init_draft = "dspark" if base.dspark else "mtp" if base.n_mtp_layers else "none"
            if c.no_mtp:
                from ..checkpoint.layouts import without_mtp

                base = without_mtp(base)
                self.init_draft = "none"
        return model_config_of(c, base)

    def _build_data(self) -> None:
        c = self.cfg
        self.mcfg = self._model_config()
        docs = data.spread(data.find_documents(c.data), c.max_docs)
        if c.tokenizer:
            tok = Tokenizer.from_file(c.tokenizer)
        elif c.init_from and (Path(c.init_from) / "tokenizer.json").exists():
            tok = Tokenizer.from_file(c.init_from)
        elif self.rank > 0:  # rank 0 trains the tokenizer; the others read its file
            self._barrier()
            tok = Tokenizer.from_file(self.out / "tokenizer")
        else:
            # a deterministic spread of documents (every n-th) so tokenizer training stays quick
            sample = [d for d in data.spread(docs, c.tokenizer_docs) if not data.is_held_out(d[0], c.held_out_pct)]
            tok = Tokenizer.train((data.read_text(p) for _, p in sample), vocab_size=self.mcfg.vocab_size)
            tok.save(self.out / "tokenizer")
            if self.world > 1:
                self._barrier()
        self.tok = tok
        if tok.vocab_size > self.mcfg.vocab_size or c.tokenizer:
            if c.init_from and tok.vocab_size > self.mcfg.vocab_size:
                raise UserError(f"tokenizer has {tok.vocab_size} tokens, the model {self.mcfg.vocab_size}")
            if not c.init_from:
                self.mcfg = self.mcfg.replace(vocab_size=tok.vocab_size)
        self.mcfg = self.mcfg.replace(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
        self.mcfg.validate()
        cache = c.cache_dir or str(self.out / "cache")
        if self.rank > 0:  # rank 0 tokenizes into the cache first; the others read it
            self._barrier()
        train, held = data.tokenize_corpus(tok, docs, c.held_out_pct, cache)
        if self.rank == 0 and self.world > 1:
            self._barrier()
        self.log(f"data: {data.corpus_summary(docs, train, held)}")
        self.loader = data.PackedLoader(train, c.seq_len, c.batch_size, seed=c.seed, rank=self.rank, world=self.world)
        self.eval_tokens = data.eval_windows(held, c.seq_len, c.eval_windows)

    def _build_model(self) -> None:
        from ..model import DeepSeekV4

        c = self.cfg
        if c.init_from:
            from ..checkpoint import load_pretrained

            # built from the run's config (overrides and QAT switches applied before the build)
            if c.draft is None or c.draft == self.init_draft:
                model = load_pretrained(
                    c.init_from, dtype=torch.float32, device=self.device, config=self.mcfg, mtp=not c.no_mtp
                )
            else:  # a new draft for the checkpoint's main model: random, then trained
                main = load_pretrained(
                    c.init_from, dtype=torch.float32, device=self.device, mtp=False, quant_mode="w8a16"
                )
                model = DeepSeekV4.from_config(self.mcfg, seed=c.seed, dtype=torch.float32, device=self.device)
                missing = model.load_state_dict(main.state_dict(), strict=False).missing_keys
                assert all(k.startswith("mtp.") for k in missing), missing
                del main
        else:
            model = DeepSeekV4.from_config(self.mcfg, seed=c.seed, dtype=torch.float32, device=self.device)
        if c.freeze_main:
            if not self.mcfg.n_mtp_layers:
                raise UserError(
                    "--freeze-main trains the draft alone, and this model has none (--draft mtp or "
                    "--draft dspark adds one)"
                )
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("mtp."))
        if self.mcfg.dspark and self.dist is not None:
            raise UserError(
                "a DSpark draft trains in one process for now (its blocks run outside the sharded "
                "forward): run without torchrun"
            )
        model.train()
        model.set_options(
            fp4_fake_quant=c.fp4_experts,
            activation_checkpointing=c.activation_checkpointing,
            head_precision=c.head_precision,
        )
        if self.dist is None and self.precision == "bf16":  # experts cast, head split once a step (casts.py)
            self.casts = StepCasts.attach(model, self.device, c.head_precision, experts=not c.fp4_experts)
        if self.dist is not None:
            sharded = self.dist.shard_model(model, ep=c.expert_parallel)
            model = sharded if sharded is not None else model
        self.model = model

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _backend(self):
        return ops.use_backend(self.cfg.backend) if self.cfg.backend else contextlib.nullcontext()

    # ---------------------------------------------------------------- collectives
    def _barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def _mean(self, x: float) -> float:
        if self.world == 1:
            return x
        t = torch.tensor([x], device=self.device, dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t) / self.world

    # ---------------------------------------------------------------- one step
    def train_step(self, tokens: torch.Tensor | list[torch.Tensor]) -> dict[str, Any]:
        """One optimizer step on a batch, or on a list of micro-batches whose gradients add up (`micro`)."""
        c, m = self.cfg, self.model
        micro = tokens if isinstance(tokens, list) else [tokens]
        sums = MicroSums(routers_with_load(m)) if len(micro) > 1 else None
        for i, t in enumerate(micro):
            tokens = t.to(self.device, non_blocking=True)
            self._micro = i
            if c.cuda_graph:
                parts = self._graphed_forward_backward(tokens, len(micro), first=i == 0)
            else:
                with self._backend(), self._autocast():
                    parts = self._losses(tokens)
                (parts.total if sums is None else parts.total / len(micro)).backward()
            if sums is not None:
                sums.add(parts)
        if sums is not None:
            parts = sums.result()
        max_norm = c.grad_clip if c.grad_clip > 0 else math.inf
        gnorm_t = self._grad_norm()  # on the device; clipping waits for it
        if self.dist is not None:  # global loads: identical bias on every rank
            self.dist.all_reduce_expert_load(m)
        # the step's one device -> host read: grad norm, loss parts (mean over ranks), expert-load ratios
        floats = parts.tensors()
        names = list(floats)
        vec = torch.stack([floats[k].detach().float().reshape(()) for k in names]) if names else None
        if vec is not None and self.world > 1:
            torch.distributed.all_reduce(vec)
            vec = vec / self.world
        ratios = balance.load_ratio_tensor(m)
        host = clipping.read_host(gnorm_t, vec, ratios)
        gnorm = host[0]
        losses_row = dict(zip(names, host[1 : 1 + len(names)]))
        load_ratios = [round(v, 3) for v in host[1 + len(names) :]]
        # A finite norm means every gradient element is finite; only a non-finite norm needs the count (a
        # float overflow of the squares can make the norm inf with finite elements: then the count is 0 and
        # the step goes ahead with clipped gradients, as before).
        nonfinite = 0 if math.isfinite(gnorm) else self._count_nonfinite()
        bad_loss = not all(math.isfinite(v) for v in losses_row.values())
        row: dict[str, Any] = {}
        if self._diag_now():  # scale-free: read before clipping
            row["muon_ortho_err"] = self._muon_error()
        lr = self.opt.set_lr_factor(lr_factor(self.step + 1, c.steps, c.warmup, c.schedule, c.min_lr_ratio))
        if nonfinite == 0 and not bad_loss:
            self._update(max_norm, gnorm_t)
        self.opt.zero_grad()
        self.step += 1
        row.update(losses_row)
        row.update(
            step=self.step,
            grad_norm=gnorm,
            lr=lr,
            nonfinite=nonfinite,
            skipped=nonfinite > 0 or bad_loss,
            expert_load_max_min=load_ratios,
        )
        if self._diag_now(before=False):
            row["mhc_violation"] = self._mhc(tokens)  # (the last micro-batch)
        return row

    def _update(self, max_norm: float, gnorm_t: torch.Tensor) -> None:
        """Clipping by the device norm (copied into a buffer of the update's own), the optimizer step and the
        router-bias update; under --cuda-graph replayed from a CUDA graph from the second step on
        (`graphed.ReplayAfterFirst`: the gradients are GraphedBackward's buffers, the lrs device scalars)."""
        if self._gnorm_in is None:
            self._gnorm_in = gnorm_t.detach().clone()
            target = self.model.mtp if self.cfg.freeze_main else self.model

            def update() -> None:
                self._clip(max_norm, self._gnorm_in)
                self.opt.step()
                balance.update_bias(target, self.cfg.bias_gamma)
                if self.casts is not None:
                    self.casts.refresh()

            self._updater = ReplayAfterFirst(update) if self.cfg.cuda_graph else update
        self._gnorm_in.copy_(gnorm_t)
        self._updater()

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients as a device scalar (no host sync): foreach norms, or under
        torch.distributed the sharded/expert-parallel norm of `distributed.grad_norm`."""
        if self.dist is not None:
            return self.dist.grad_norm(self.model)
        return clipping.total_norm(self._grads(), self.device)

    def _clip(self, max_norm: float, total: torch.Tensor) -> None:
        """Scale every gradient by min(1, max_norm / (total + 1e-6)), a device scalar (no host sync)."""
        if self.dist is not None:
            self.dist.scale_grads_(self.model, max_norm, total)
            return
        clipping.clip_(list(self.model.parameters()), max_norm, total)

    def _count_nonfinite(self) -> int:
        """Non-finite gradient elements over all ranks (host syncs: only called when the norm is not finite)."""
        n = sum(int((~torch.isfinite(g.to_local() if hasattr(g, "to_local") else g)).sum()) for g in self._grads())
        return int(self._mean(float(n)) * self.world)

    def _losses(self, tokens: torch.Tensor) -> LossParts:
        c = self.cfg
        if self.mcfg.dspark:
            return self._dspark_losses(tokens)
        want_mtp = c.mtp_weight > 0 and self.mcfg.n_mtp_layers > 0
        if c.freeze_main:  # the MTP block alone: its loss is the objective (the main
            out = self.model(tokens, mtp=True)  # model's parameters take no gradient)
            parts = total_loss(out, tokens, 1.0, 0.0)
            return LossParts(parts.mtp, parts.lm.detach(), parts.mtp)
        out = self.model(tokens, mtp=want_mtp, indexer_loss=c.indexer_weight > 0, balance_alpha=c.balance_alpha)
        return total_loss(out, tokens, c.mtp_weight, c.indexer_weight)

    def _dspark_losses(self, tokens: torch.Tensor) -> LossParts:
        """The main model's losses (none with --freeze-main: it runs without gradients) plus the DSpark
        draft's (`dsv4.train.dspark_loss`), weighted by mtp_weight when both train."""
        c = self.cfg
        frozen = c.freeze_main
        with torch.no_grad() if frozen else contextlib.nullcontext():
            out = self.model(
                tokens,
                taps=True,
                indexer_loss=c.indexer_weight > 0 and not frozen,
                balance_alpha=0.0 if frozen else c.balance_alpha,
            )
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + self.step * 7919 + self.rank + self._micro * 104_729)
        anchors = sample_anchors(tokens.size(0), tokens.size(1), c.dspark_anchors, gen, tokens.device)
        d = dspark_loss(
            self.model,
            tokens,
            out.taps,
            out.logits,
            anchors,
            DSparkLossConfig(
                c.dspark_anchors, c.dspark_ce_alpha, c.dspark_l1_alpha, c.dspark_confidence_alpha, c.dspark_gamma
            ),
        )
        main = total_loss(out, tokens, 0.0, c.indexer_weight)
        total = d.total if frozen else main.total + c.mtp_weight * d.total
        return LossParts(
            total,
            main.lm.detach() if frozen else main.lm,
            indexer=main.indexer,
            balance=main.balance,
            dspark=d.total.detach(),
            dspark_tau=d.tau,
        )

    def _graphed_forward_backward(self, tokens: torch.Tensor, n_micro: int = 1, first: bool = True) -> LossParts:
        """`--cuda-graph`: forward, losses and backward replayed from one graph captured at the first call.

        The graph's outputs are the loss parts and every MoE's expert load: each MoE is handed the graph's
        load buffer after each replay (`MoE.set_load`; an eager forward in between, e.g. the held-out
        evaluation, measures its own), so the bias update reads this step's loads. With n_micro > 1
        micro-batches the graph adds into its gradient buffers (cleared by the `first`), its loss weighted
        1 / n_micro."""
        moes = routers_with_load(self.model)
        names = ("lm", "mtp", "indexer", "balance")  # LossParts besides the total
        if self._graph is None:
            from .graphed import GraphedBackward

            def loss_fn(batch: torch.Tensor) -> dict[str, torch.Tensor]:
                parts = self._losses(batch)
                out = {"loss": parts.total, **{n: getattr(parts, n) for n in names if getattr(parts, n) is not None}}
                out.update({f"load.{i}": mod.load for i, mod in enumerate(moes) if mod.load is not None})
                return out

            with self._backend():
                self._graph = GraphedBackward(
                    self.model,
                    loss_fn,
                    tokens,
                    torch.bfloat16 if self.precision == "bf16" else None,
                    accumulate=n_micro > 1,
                    loss_scale=1.0 / n_micro,
                )
        out = self._graph.run(tokens, zero=first)
        for i, mod in enumerate(moes):
            mod.set_load(out.get(f"load.{i}", mod.load))
        return LossParts(total=out["loss"], **{n: out.get(n) for n in names})

    def _diag_now(self, before: bool = True) -> bool:
        k = self.cfg.diag_every
        step = self.step + 1 if before else self.step
        return k > 0 and (step % k == 0 or step == 1)

    def _muon_error(self) -> float | None:
        """Orthogonalization error of Muon's Newton-Schulz on the largest 2-D hidden matrix's gradient."""
        ps = [p for p in self.opt.muon_params if p.grad is not None]
        if not ps:
            return None
        g = max(ps, key=lambda p: p.numel()).grad
        return orthogonalization_error(g.full_tensor() if hasattr(g, "full_tensor") else g)

    def _mhc(self, tokens: torch.Tensor) -> float:
        was = self.model.training
        self.model.eval()
        try:
            with self._backend(), self._autocast():
                return metrics.mhc_violation(self.model, tokens[:1, : min(tokens.size(1), 256)])
        finally:
            self.model.train(was)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token cross-entropy over the fixed held-out windows."""
        m = self.model
        was = m.training
        m.eval()
        total, n = 0.0, 0
        try:
            for i in range(0, self.eval_tokens.size(0), self.cfg.batch_size):
                x = self.eval_tokens[i : i + self.cfg.batch_size].to(self.device)
                with self._backend(), self._autocast():
                    logits = m(x).logits
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1), reduction="sum"
                )
                total += float(loss)
                n += x[:, 1:].numel()
        finally:
            m.train(was)
        return total / n

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path | None:
        # collectives under torch.distributed: every rank gathers, rank 0 writes (the single-process layout)
        if self.dist is not None:
            tensors = {k: v.cpu() for k, v in self.dist.full_state_dict(self.model).items()}
            optim_tensors = self.dist.full_optimizer_state(self.opt, self.model, keep=self.rank == 0)
        else:
            tensors = checkpoint.model_tensors(self.model)
            optim_tensors = checkpoint.optimizer_tensors(self.opt, self.model)
        if self.rank != 0:
            return None
        state = {
            "step": self.step,
            "loader": self.loader.state_dict(),
            "train_config": self.cfg.to_dict(),
            "model_config": self.mcfg.to_dict(),
            "history": self.history[-HISTORY_KEPT:],
        }
        root = self.out / "checkpoints"
        latest = checkpoint.latest_name(root)
        kept = f"the last complete checkpoint, {latest}, is kept" if latest else "no checkpoint was written yet"
        with writing(root, kept=f"{kept}; metrics.jsonl has every step so far"):
            return checkpoint.save(root, self.step, tensors, optim_tensors, state, keep=self.cfg.keep_checkpoints)

    def _resume(self, where: str) -> None:
        path = self.out / "checkpoints" if where == "auto" else Path(where)
        if where == "auto" and not os.path.lexists(path / "latest"):
            self.log("resume: no checkpoint yet, starting fresh")
            return
        if os.path.lexists(path / "latest"):
            path = _follow_latest(path)
        ckpt, tensors, optim_state, state = checkpoint.load(path, map_location=self.device)
        if state["model_config"] != self.mcfg.to_dict():
            raise UserError(f"{ckpt}: checkpoint was written for a different model config")
        want = set(self.model.state_dict())
        if set(tensors) != want:
            raise checkpoint.CorruptCheckpoint(
                f"{ckpt}: tensors do not match the model (missing "
                f"{sorted(want - set(tensors))[:3]}, unexpected "
                f"{sorted(set(tensors) - want)[:3]})"
            )
        try:
            if self.dist is not None:
                self.dist.load_full_state_dict(self.model, tensors)
                self.dist.load_full_optimizer_state(self.opt, self.model, optim_state)
            else:
                self.model.load_state_dict(tensors)
                checkpoint.load_optimizer_tensors(self.opt, self.model, optim_state)
        except (ValueError, KeyError) as e:
            raise checkpoint.CorruptCheckpoint(f"{ckpt}: optimizer state does not fit ({e})") from None
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        self.history = list(state.get("history", []))
        self.log(f"resumed from {ckpt} at step {self.step}")

    # ---------------------------------------------------------------- the job
    def describe(self) -> dict[str, Any]:
        """Memory estimate and live dtypes before step 1 (docs/bugzoo.md Z21)."""
        per = {n: 1 for n in self.opt.muon_names} | {n: 2 for n in self.opt.adamw_names}
        est = metrics.memory_estimate(self.model, per)
        # DTensor.numel() is global; expert-parallel experts are rank-local slices of W equal parts
        ep = getattr(self.dist, "is_expert_param", lambda p: False) if self.dist else (lambda p: False)
        n_params = sum(p.numel() * (self.world if ep(p) else 1) for p in self.model.parameters())
        flops = metrics.train_flops_per_token(self.mcfg, self.cfg.seq_len, mtp=self.cfg.mtp_weight > 0)
        return {
            "params": n_params,
            "muon_params": len(self.opt.muon_names),
            "adamw_params": len(self.opt.adamw_names),
            "precision": self.precision,
            "device": str(self.device),
            "world": self.world,
            "grad_accum": self.cfg.grad_accum,
            "tokens_per_step": self.cfg.batch_size * self.cfg.seq_len * self.cfg.grad_accum,
            "train_flops_per_token": flops,
            **est,
        }

    def fit(self) -> dict[str, Any]:
        c = self.cfg
        info = self.describe()
        if self.rank == 0:
            self.log("model: " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in info.items()}))
            # weights, gradients and optimizer state only: the activations of a step come on top and usually
            # dominate (the shipped recipe: 0.14 GiB of these, 24.7 GiB peak on the GPU), so no peak is
            # predicted here; each step logs the measured peak (peak_mem_gib)
            self.log(
                f"live parameter dtypes: {info['param_dtypes']}; compute: "
                f"{'bf16 autocast' if self.precision == 'bf16' else 'fp32'}; parameter memory: "
                f"weights {info['weights_gib']:.3f} GiB + grads {info['grads_gib']:.3f} GiB + optimizer "
                f"{info['optimizer_gib']:.3f} GiB = {info['total_gib']:.3f} GiB, activations not included "
                f"(the measured peak is logged per step as peak_mem_gib)"
            )
            self.jsonl.write(
                {
                    "event": "start",
                    **{k: v for k, v in info.items()},
                    "config": c.to_dict(),
                    "model_config": self.mcfg.to_dict(),
                }
            )
        peak = metrics.peak_tflops(self.device, c.peak_tflops)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        bar = None
        if c.progress and self.rank == 0 and sys.stderr.isatty():  # a bar on a terminal, else a line per 10 steps
            from ..progress import bar as progress_bar

            bar = progress_bar(c.steps, "train", unit="step", initial=self.step)
        global_tokens = c.batch_size * c.seq_len * c.grad_accum
        last_eval = None
        if self.step == 0 and c.eval_every > 0:
            last_eval = self.evaluate()
            self._record({"step": 0, "eval_loss": last_eval})
        t_start = time.perf_counter()
        tokens_done = 0
        step_times: list[float] = []
        first_step = self.step
        stopped = False  # by stop_after_s: a stage of a longer run
        while self.step < c.steps:
            batch = [self.loader.next_batch() for _ in range(c.grad_accum)]  # micro-batches
            t0 = time.perf_counter()
            row = self.train_step(batch)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            if c.time_budget_s > 0 and self.step - first_step == 12:
                self._fit_budget(step_times[2:], time.perf_counter() - t_start, bar)
            tokens_done += global_tokens
            tps = global_tokens / dt
            row.update(
                tokens_per_s=round(tps, 1),
                step_time_s=round(dt, 4),
                mfu=(info["train_flops_per_token"] * tps / (peak * 1e12 * self.world)) if peak else None,
                peak_mem_gib=round(metrics.peak_memory_gib(self.device), 4),
                epoch=self.loader.state.epoch,
            )
            if c.eval_every > 0 and (self.step % c.eval_every == 0 or self.step == c.steps):
                last_eval = self.evaluate()
                row["eval_loss"] = last_eval
            self._record(row)
            self._stop_if_nonfinite(row, bar)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    loss=f"{row['loss']:.3f}", eval=f"{last_eval:.3f}" if last_eval else "-", tok_s=f"{tps:,.0f}"
                )
            elif self.rank == 0 and (self.step % 10 == 0 or self.step in (1, c.steps)):
                # without a progress bar a line every 10 steps (and the last): a slow run never looks stalled
                self.log(
                    f"step {self.step}/{c.steps} loss {row['loss']:.4f} lm {row['lm']:.4f} "
                    f"eval {last_eval if last_eval is None else round(last_eval, 4)} "
                    f"grad_norm {gnorm_fmt(row)} {tps:,.0f} tok/s"
                )
            if c.save_every > 0 and self.step % c.save_every == 0:
                self.save_checkpoint()
            if c.stop_after_s and self.step < c.steps and self._mean(time.perf_counter() - t_start) >= c.stop_after_s:
                stopped = True  # (every rank decides on the same mean)
                break
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - t_start
        summary = {
            "steps": self.step,
            "final_eval_loss": last_eval,
            "wall_s": round(wall, 1),
            "mean_tokens_per_s": round(tokens_done / wall, 1) if wall > 0 else None,
        }
        if c.save_every >= 0 and self.rank == 0:
            summary["checkpoint"] = str(self.save_checkpoint())
        elif c.save_every >= 0:
            self.save_checkpoint()
        if stopped:  # a stage: the run's end (sample, export) comes with its last stage
            if self.rank == 0:
                summary["stopped"] = f"after {wall:.0f} s at step {self.step} of {c.steps}: --resume continues"
                self.log(f"stage done: {summary['stopped']}")
                self.jsonl.write({"event": "stage", **summary})
            self._barrier()
            return summary
        # After the last step every rank takes the same path: a sharded model cannot sample or export on one
        # rank (its FSDP gathers and expert exchanges need every rank), so all ranks gather one plain copy
        # (a collective), rank 0 alone samples / exports with it, and the others wait at a barrier.
        plain = self.model
        if self.world > 1 and (c.sample_prompt or c.export):
            plain = self.dist.unsharded_copy(self.model)
        if self.rank == 0:
            # the log holds every stage of a resumed run; the history only what the checkpoint carried
            png = metrics.plot_losses(self.jsonl.rows() or self.history, self.out / "loss.png")
            summary["plot"] = str(png) if png else f"not written: {metrics.PLOT_UNAVAILABLE}"
            if c.sample_prompt:
                summary["sample"] = self.sample(c.sample_prompt, model=plain)
            if c.export:
                summary["export"] = str(self.export(c.export, model=plain))
            self.jsonl.write({"event": "end", **summary})
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        del plain
        self._barrier()
        return summary

    def close(self) -> None:
        """Leave the process group this trainer joined (every rank, after `fit`); nothing on one process."""
        if self.world > 1:
            self._barrier()
            self.dist.teardown_distributed()
            self.world = 1

    def _fit_budget(self, times: list[float], elapsed: float, bar) -> None:
        """Shorten the run so that it ends within time_budget_s (decided early, before the schedule decays)."""
        c = self.cfg
        per = self._mean(sum(times) / len(times))
        fwd = per / 3 / c.grad_accum  # a forward of one batch: about a third of its forward + backward
        evals = c.eval_windows / max(1, c.batch_size) * fwd / max(1, c.eval_every) if c.eval_every else 0
        left = int(max(0.0, c.time_budget_s - self._mean(elapsed)) * 0.97 / (per + evals))
        steps = max(self.step + 1, min(c.steps, self.step + left))
        if steps < c.steps:
            self.log(
                f"time budget {c.time_budget_s:.0f} s at {per:.3f} s/step: training {steps} steps instead of {c.steps}"
            )
            c.steps = steps
            if bar is not None:
                bar.total = steps

    def _stop_if_nonfinite(self, row: dict, bar) -> None:
        """Raise RunFailed (exit 1) where the step's numbers stop the run (`stops.nonfinite_stop`)."""
        why = nonfinite_stop(row, self.cfg.skip_nonfinite, self.out / "checkpoints")
        if why:
            if bar is not None:
                bar.close()
            raise RunFailed(why)

    def _record(self, row: dict) -> None:
        self.history.append(row)
        if self.rank == 0:
            self.jsonl.write(row)

    # ---------------------------------------------------------------- outputs
    @torch.no_grad()
    def sample(self, prompt: str, max_new_tokens: int = 48, model: torch.nn.Module | None = None) -> str:
        """Greedy continuation of `prompt` by `model` (default: the trained model; under torch.distributed
        pass an unsharded copy, which one rank can run alone)."""
        from ..engine import generate

        m = self.model if model is None else model
        was = m.training
        m.eval()
        try:
            with self._backend():
                ids = generate(m, [self.tok.encode(prompt, bos=True)], max_new_tokens=max_new_tokens)[0]
        finally:
            m.train(was)
        return prompt + self.tok.decode(ids)

    def export(self, dst: str | Path, model: torch.nn.Module | None = None) -> Path:
        """Write a bf16 inference checkpoint (release layout) with config and tokenizer files (`model`: as in
        `sample`)."""
        from ..checkpoint.writer import model_values, save

        self.tok.save(self.out / "tokenizer")
        return save(
            model_values(self.model if model is None else model),
            self.mcfg,
            dst,
            target="bf16",
            copy_from=self.out / "tokenizer",
            shard_bytes=12 << 20,
        )


def gnorm_fmt(row: dict) -> str:
    return f"{row['grad_norm']:.3f}"


def train(cfg: TrainConfig, log=print) -> dict[str, Any]:
    trainer = Trainer(cfg, log)
    try:
        return trainer.fit()
    finally:
        trainer.close()
