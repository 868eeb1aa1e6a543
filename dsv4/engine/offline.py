"""Offline generation: prompts in, continuations out, through the serving engine.

The same engine that serves HTTP requests runs here, so `dsv4 generate`, the Python API and the server
produce the same tokens for the same prompt, settings and seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..model import DeepSeekV4
from .detokenize import StopChecker
from .engine import Engine, EngineConfig
from .healing import Healed, Vocabulary, heal
from .sampling import SamplingParams


def generate(
    model: DeepSeekV4,
    prompts: list[list[int]] | list[Healed],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop_at_eos: bool = True,
    eos_token_id: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    cuda_graph: bool = False,
    deterministic: bool = False,
    engine_config: EngineConfig | None = None,
    speculative: int = 0,
    speculative_threshold: float = 0.0,
    tokenizer=None,
    token_healing: bool = True,
    engine: Engine | None = None,
    stop: Sequence[str] = (),
) -> list[list[int]]:
    """Continue each prompt (lists of token ids) -> the generated ids of each. temperature 0 = greedy.

    Prompt i samples with seed `seed + i` (seed None: 0), so a prompt's continuation does not depend on
    the other prompts. `on_token(i, token)` is called for every generated token as it comes (streaming).
    With cuda_graph=True (CUDA only), decode steps replay captured CUDA graphs. speculative=k drafts k tokens
    per step with the model's draft, its MTP block or a DSpark draft (the same tokens for greedy decoding;
    `dsv4.engine.speculative`, `dsv4.engine.dspark_step`); speculative_threshold: a DSpark draft verifies
    the drafts whose survival probability is at least this (0: always k).

    Token healing (`dsv4.engine.healing`): with a `tokenizer` and token_healing, each id prompt is healed
    (`heal(Vocabulary.of(tokenizer), ids)`): its last tokens that the tokenizer could merge with what
    follows are removed and the first generated tokens must spell them again. A prompt may also be given
    healed already (a `Healed`). The ids returned follow the healed prompt (`Healed.prompt`), so a healed
    continuation starts with the removed text; `complete` returns the text after the prompt's instead.
    A prompt whose last token nothing extends is run exactly as without healing.
    engine: run on this engine (one the caller built, e.g. on several workers) instead of a new one; the
    settings of the engine apply (it needs the tokenizer to run healed prompts).
    stop: strings that end a sequence where its text (after the prompt) first holds one (needs the
    tokenizer); its ids end with the token that completed the string, as the server's do.
    """
    healed = _healed(prompts, tokenizer, token_healing)
    if not healed or any(not h.prompt for h in healed):
        raise ValueError("empty prompt: give at least one token (e.g. BOS)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if tokenizer is None and any(h.text for h in healed):
        raise ValueError("healed prompts need the tokenizer they were healed with (tokenizer=...)")
    if stop and tokenizer is None:
        raise ValueError("stop strings need the tokenizer (tokenizer=...)")
    if engine is None:
        longest = max(len(h.prompt) for h in healed) + max_new_tokens
        config = engine_config or EngineConfig(
            max_seqs=min(len(healed), 64),
            max_model_len=min(longest, model.cfg.max_seq_len),
            cuda_graphs=cuda_graph,
            deterministic=deterministic,
            prefix_caching=False,
            speculative=speculative,
            speculative_threshold=speculative_threshold,
        )
        # text (and so stop strings) only where asked for: detokenizing costs host time per token
        engine = Engine(model, config, tokenizer=tokenizer, eos_token_id=eos_token_id, detokenize=bool(stop))
    base = 0 if seed is None else seed
    for i, h in enumerate(healed):
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=base + i,
            ignore_eos=not stop_at_eos,
            heal_text=h.text,
            stop=list(stop),
        )
        engine.add_request(str(i), h.prompt, params)
    results: list[list[int]] = [[] for _ in healed]
    while engine.has_work():
        for out in engine.step():
            i = int(out.request_id)
            results[i].extend(out.new_tokens)
            if on_token is not None:
                for t in out.new_tokens:
                    on_token(i, t)
    return results


def _healed(prompts: list[list[int]] | list[Healed], tokenizer, token_healing: bool) -> list[Healed]:
    vocab = Vocabulary.of(tokenizer) if tokenizer is not None and token_healing else None
    out = []
    for p in prompts:
        if isinstance(p, Healed):
            out.append(p)
        else:
            out.append(heal(vocab, list(p)) if vocab is not None else Healed(list(p)))
    return out


@dataclass
class Completion:
    """One prompt's continuation as text: `prompt_text + text` is the whole text (token healing or not)."""

    prompt: list[int]  # the ids the model read (healed: without the removed tokens)
    tokens: list[int]  # the generated ids, following `prompt`
    text: str  # the completion after the prompt's text
    healed_text: str = ""  # the prompt's text that healing removed and `tokens` spell again
    eos: bool = False  # ended by the end-of-sequence token
    stopped: bool = False  # ended by one of the stop strings (`text` ends before it)


def complete(
    model: DeepSeekV4, tokenizer, prompts: list[str], token_healing: bool = True, bos: bool = True, **kwargs
) -> list[Completion]:
    """Continue text prompts (encoded with BOS, healed unless token_healing=False) -> their `Completion`s;
    kwargs are `generate`'s (sampling, on_token, stop, ...). A completion that a stop string ended ends
    before it, as the server's text does (its last token may spell more than the string)."""
    vocab = Vocabulary.of(tokenizer)
    healed = []
    for text in prompts:
        ids = ([tokenizer.bos_id] if bos else []) + tokenizer.encode(text)
        healed.append(heal(vocab, ids) if token_healing else Healed(ids))
    eos = kwargs.get("eos_token_id")
    eos = tokenizer.eos_id if eos is None else eos
    stops = StopChecker(list(kwargs.get("stop", ())))  # the engine's rule, to cut the whole text where it stopped
    done = []
    for h, o in zip(healed, generate(model, healed, tokenizer=tokenizer, **kwargs)):
        text = h.completion(tokenizer.decode(o))
        at = stops.check(text, len(text))
        done.append(Completion(h.prompt, o, text[:at], h.text, bool(o) and o[-1] == eos, at is not None))
    return done
