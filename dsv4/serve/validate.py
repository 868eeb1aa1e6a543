"""Everything about a request that can be refused is refused here, before the engine sees it, each with a
400 that names its `param`.

The engine runs every sequence of a step in one batch, so a request it cannot take must never reach it:
an integer past int64 in `top_k` once failed the whole step (every other client's request with it).
Here every sampling field is checked against the ranges of `dsv4.sampling_limits` (the command line
uses the same table), integers are bounded (top_k by the vocabulary, token ids by it too), and a request
is refused when the server could never hold it: past the context, past the cache (`--cache-pages`), or
with more sequences (prompts x n) than `--max-seqs-per-request`. Large inputs are bounded before they are
parsed further: messages per request (`--max-messages`) and characters per prompt (`--max-prompt-chars`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from ..engine.params import SamplingParams
from ..sampling_limits import MAX_STOP, Range, refusal, top_k_range
from .protocol import APIError, ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Limits:
    """What this server can take (from its flags and its engine)."""

    vocab_size: int
    max_model_len: int  # prompt + output, per sequence
    max_sequence_tokens: int  # the longest sequence the cache holds alone (<= max_model_len)
    max_n: int = 16  # choices per prompt
    max_seqs_per_request: int = 64  # prompts x n
    max_messages: int = 1024  # chat messages per request
    max_prompt_chars: int = 1 << 20  # characters per prompt / per message content
    cache_flag: str = "--cache-pages"  # what raises max_sequence_tokens


def validated(model_cls: type[BaseModel], body: dict) -> BaseModel:
    """The body as `model_cls`, or a 400 naming the first field that does not fit (param = the field)."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if not _union_tag(x)]
        param = loc[0] if loc else None
        where = ".".join(loc)
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise APIError(400, f"{where}: {msg}" if where else msg, param=param) from None


def _union_tag(x: object) -> bool:
    """pydantic's names of union members in an error location (`str`, `list[int]`, `function-before[...]`)."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "dict", "list") or "[" in x)


def _check(name: str, value: object, rng=None, param: str | None = None) -> None:
    why = refusal(name, value, rng)
    if why:
        raise APIError(400, f"{param or name} {why}", param=param or name)


def check_input_size(body: dict, limits: Limits, chat: bool) -> None:
    """Bounds on the raw body before it is validated further (cheap: lengths only)."""
    if chat:
        msgs = body.get("messages")
        if isinstance(msgs, list):
            if len(msgs) > limits.max_messages:
                raise APIError(
                    400,
                    f"messages: {len(msgs)} messages; this server takes at most "
                    f"{limits.max_messages} per request (--max-messages)",
                    param="messages",
                )
            total = sum(_text_chars(m) for m in msgs)
            if total > limits.max_prompt_chars:
                raise APIError(
                    400,
                    f"messages hold {total} characters of text; this server takes at most "
                    f"{limits.max_prompt_chars} per prompt (--max-prompt-chars)",
                    param="messages",
                )
        return
    prompt = body.get("prompt")
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    for i, p in enumerate(texts):
        if isinstance(p, (str, list)) and len(p) > limits.max_prompt_chars:
            kind = "characters" if isinstance(p, str) else "token ids"
            raise APIError(
                400,
                f"prompt{'' if isinstance(prompt, str) else f'[{i}]'} has {len(p)} {kind}; this "
                f"server takes at most {limits.max_prompt_chars} per prompt (--max-prompt-chars)",
                param="prompt",
            )
    n_prompts = len(texts) if isinstance(prompt, list) and texts and not isinstance(texts[0], int) else 1
    n = body.get("n", 1)
    if (
        isinstance(n, int)
        and not isinstance(n, bool)
        and 1 <= n <= limits.max_n  # (else: n's own 400)
        and n_prompts * n > limits.max_seqs_per_request
    ):
        raise APIError(
            400,
            f"{n_prompts} prompts x n={n} = {n_prompts * n} sequences; this server runs at most "
            f"{limits.max_seqs_per_request} per request (--max-seqs-per-request)",
            param="prompt" if n_prompts > 1 else "n",
        )


def _text_chars(message: object) -> int:
    """Characters of text in one message (its string fields and content parts; lengths only, no copies)."""
    if not isinstance(message, dict):
        return 0
    n = 0
    for v in message.values():
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, list):
            n += sum(len(x) for part in v if isinstance(part, dict) for x in part.values() if isinstance(x, str))
    return n


def check_fields(req: CompletionRequest | ChatCompletionRequest, limits: Limits) -> None:
    """Every sampling field against its range (dsv4.sampling_limits), n against the server's limit."""
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
    ):
        v = getattr(req, name)
        if v is not None:
            _check(name, v)
    if req.top_k is not None:
        _check("top_k", req.top_k, top_k_range(limits.vocab_size))
    _check("n", req.n, Range(1, limits.max_n, integer=True))
    for name in ("max_tokens", "max_completion_tokens"):
        # (a field the request type lacks is absent: pydantic's failing attribute lookup is slow)
        v = getattr(req, name) if name in type(req).model_fields else None
        if v is not None:
            _check("max_tokens", v, param=name)
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            _check("logprobs", req.logprobs)
    elif req.top_logprobs is not None:
        _check("top_logprobs", req.top_logprobs)
        if not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise APIError(400, f"stop must be at most {MAX_STOP} non-empty strings", param="stop")
    bad = [t for t in req.stop_token_ids or [] if not 0 <= t < limits.vocab_size]
    if bad:
        raise APIError(
            400,
            f"stop_token_ids must be token ids in [0, {limits.vocab_size}), got {_short(bad[0])}",
            param="stop_token_ids",
        )


def check_prompt_ids(prompts: list[list[int]], limits: Limits, param: str) -> None:
    for ids in prompts:
        if not ids:
            raise APIError(400, f"{param}: a prompt is empty (give at least one token)", param=param)
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"{param}: token id {_short(bad)} is outside the vocabulary [0, {limits.vocab_size})", param=param
            )


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    limits: Limits,
    max_tokens: int | None,
    prompt_len: int,
    logprobs: int | None,
    chat: bool,
    heal_text: str = "",
) -> SamplingParams:
    """The engine's settings for one prompt, after the context and the cache are known to hold it
    (prompt_len: the prompt as the engine runs it, healed; heal_text: its token-healing constraint)."""
    prompt_param = "messages" if chat else "prompt"
    mt_param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; this server's context is {limits.max_model_len} "
            f"tokens (prompt + output), so at most {limits.max_model_len - 1} prompt tokens fit",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(
            400,
            f"{mt_param}={max_tokens} plus the prompt's {prompt_len} tokens exceeds the context "
            f"of {limits.max_model_len} tokens: at most {room} new tokens fit",
            param=mt_param,
            code="context_length_exceeded",
        )
    cap = limits.max_sequence_tokens
    if prompt_len + max_tokens > cap:
        fit = cap - prompt_len
        raise APIError(
            400,
            f"the prompt's {prompt_len} tokens plus {mt_param}={max_tokens} need a cache of "
            f"{prompt_len + max_tokens} positions; this server's cache holds at most {cap} per "
            f"sequence ({limits.cache_flag}), so "
            + (f"at most {fit} new tokens fit" if fit >= 1 else "this prompt never fits"),
            param=mt_param if fit >= 1 else prompt_param,
            code="context_length_exceeded",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = req.top_k or 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(top_k, 0),
            min_p=req.min_p or 0.0,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            skip_special_tokens=not chat,
            include_stop_str_in_output=req.include_stop_str_in_output,
            heal_text=heal_text,
        )
    except ValueError as e:  # (the ranges above are inside the engine's: not reached)
        param = str(e).split(":", 1)[0]
        raise APIError(400, str(e), param=param) from None


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"
