"""Offline generation: prompts in, continuations out, through the serving engine.

The same engine that serves HTTP requests runs here, so `dsv4 generate`, the Python API and the server
produce the same tokens for the same prompt, settings and seed.
"""

from __future__ import annotations

from collections.abc import Callable

from ..model import DeepSeekV4
from .engine import Engine, EngineConfig
from .sampling import SamplingParams


def generate(model: DeepSeekV4, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop_at_eos: bool = True,
             eos_token_id: int | None = None, on_token: Callable[[int, int], None] | None = None,
             cuda_graph: bool = False, deterministic: bool = False,
             engine_config: EngineConfig | None = None, speculative: int = 0,
             speculative_threshold: float = 0.0, engine: Engine | None = None) -> list[list[int]]:
    """Continue each prompt (lists of token ids) -> the generated ids of each. temperature 0 = greedy.

    Prompt i samples with seed `seed + i` (seed None: 0), so a prompt's continuation does not depend on
    the other prompts. `on_token(i, token)` is called for every generated token as it comes (streaming).
    With cuda_graph=True (CUDA only), decode steps replay captured CUDA graphs. speculative=k drafts k tokens
    per step with the model's draft, its MTP block or a DSpark draft (the same tokens for greedy decoding;
    `dsv4.engine.speculative`, `dsv4.engine.dspark_step`); speculative_threshold: a DSpark draft verifies
    the drafts whose survival probability is at least this (0: always k). engine: run on this engine (one
    the caller built, e.g. on several workers) instead of a new one; the settings of the engine apply.
    """
    if not prompts or any(not p for p in prompts):
        raise ValueError("empty prompt: give at least one token (e.g. BOS)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if engine is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        config = engine_config or EngineConfig(
            max_seqs=min(len(prompts), 64), max_model_len=min(longest, model.cfg.max_seq_len),
            cuda_graphs=cuda_graph, deterministic=deterministic, prefix_caching=False, speculative=speculative,
            speculative_threshold=speculative_threshold)
        engine = Engine(model, config, eos_token_id=eos_token_id)
    base = 0 if seed is None else seed
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=base + i, ignore_eos=not stop_at_eos)
        engine.add_request(str(i), p, params)
    results: list[list[int]] = [[] for _ in prompts]
    while engine.has_work():
        for out in engine.step():
            i = int(out.request_id)
            results[i].extend(out.new_tokens)
            if on_token is not None:
                for t in out.new_tokens:
                    on_token(i, t)
    return results
