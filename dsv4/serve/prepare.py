"""A request body -> what the engine runs: parsed, bounded, validated, encoded and tokenized.

This is the CPU work of a request, and it grows with the input (an 8 MB prompt, a 10,000-message chat),
so the server runs it in a worker thread (`ServerState.offload`), never on the event loop: `/health`
and the streams of other clients go on meanwhile. The tokenizer's batch entry point releases the
interpreter lock while it runs; the chat encoder is Python, which yields the lock every switch interval.
Errors are `APIError`s (400 with the field's `param`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..engine.healing import Healed, Vocabulary, heal
from ..engine.params import SamplingParams
from . import chat
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, refuse_unsupported, thinking_requested
from .validate import Limits, check_fields, check_input_size, check_prompt_ids, sampling_params, validated


@dataclass
class Prepared:
    req: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]  # one per engine request (a completion may batch prompts)
    params: list[SamplingParams]
    thinking: bool = False


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays / objects too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:  # "\ud800" parses to a lone surrogate, which no text can hold
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds a string with a lone surrogate escape (not Unicode text)") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays / objects too deeply") from None
    return body


def check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(
            404,
            f"The model `{name}` does not exist (this server serves `{served}`)",
            param="model",
            code="model_not_found",
        )


def _encode(tokenizer, text: str, bos: bool) -> list[int]:
    fast = getattr(tokenizer, "encode_releasing_gil", None)
    return fast(text, bos=bos) if fast is not None else tokenizer.encode(text, bos=bos)


def _completion_prompts(tokenizer, req: CompletionRequest) -> list[Healed]:
    """The prompts as the engine runs them: text prompts encoded (with BOS) and, unless the request says
    `token_healing: false`, healed; token-id prompts exactly as given."""
    p = req.prompt
    texts = [p] if isinstance(p, str) else p if p and all(isinstance(x, str) for x in p) else None
    if texts is not None:
        vocab = Vocabulary.of(tokenizer) if req.token_healing else None
        ids = [_encode(tokenizer, x, bos=True) for x in texts]
        return [heal(vocab, x) if vocab is not None else Healed(x) for x in ids]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [Healed(list(p))]
    return [Healed(list(x)) for x in p]


def prepare_completion(raw: bytes, limits: Limits, tokenizer, model_name: str) -> Prepared:
    body = parse_body(raw)
    check_input_size(body, limits, chat=False)
    req = validated(CompletionRequest, body)
    check_model(req.model, model_name)
    refuse_unsupported(req)
    check_fields(req, limits)
    healed = _completion_prompts(tokenizer, req)
    prompts = [h.prompt for h in healed]
    check_prompt_ids(prompts, limits, "prompt")
    params = [
        sampling_params(req, limits, req.max_tokens, len(h.prompt), req.logprobs, chat=False, heal_text=h.text)
        for h in healed
    ]
    return Prepared(req, prompts, params)


def prepare_chat(raw: bytes, limits: Limits, tokenizer, model_name: str) -> Prepared:
    body = parse_body(raw)
    check_input_size(body, limits, chat=True)
    req = validated(ChatCompletionRequest, body)
    check_model(req.model, model_name)
    refuse_unsupported(req)
    check_fields(req, limits)
    thinking = thinking_requested(req)
    messages = _continued(req.messages)
    try:
        tools = req.tools if req.tool_choice != "none" else None
        if req.tools is not None and tools is None:  # left out of the prompt, checked all the same
            chat.check_tools(req.tools)
        text = chat.encode_chat(messages, tools=tools, thinking=thinking, reasoning_effort=req.reasoning_effort)
    except chat.ChatFormatError as e:
        raise APIError(400, str(e), param=_chat_param(str(e))) from None
    except RecursionError:
        raise APIError(400, "messages nest too deeply", param="messages") from None
    _check_reply_opens(messages)
    prompt = _encode(tokenizer, text, bos=False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(
        req, limits, max_tokens, len(prompt), (req.top_logprobs or 0) if req.logprobs else None, chat=True
    )
    # a continued assistant turn (its reasoning closed in the prompt) goes on with its content
    last = messages[-1]
    continued = last.get("role") == "assistant" and bool(last.get("wo_eos"))
    return Prepared(req, [prompt], [params], thinking and not continued)


def _chat_param(message: str) -> str:
    """The request field a chat format error names first ('tools[0].function.name: ...' -> 'tools')."""
    head = re.match(r"[a-z_]+", message)
    return head.group() if head and head.group() in ChatCompletionRequest.model_fields else "messages"


def _continued(messages: list[dict]) -> list[dict]:
    """DeepSeek's chat prefix completion: a last assistant message with `prefix: true` is continued, as the
    format's own `wo_eos` leaves it open."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "prefix" not in m:
            continue
        if not isinstance(m["prefix"], bool):
            raise APIError(400, f"messages[{i}].prefix: must be true or false", param="messages")
        if m["prefix"] and (i != len(messages) - 1 or m.get("role") != "assistant"):
            raise APIError(
                400, f"messages[{i}].prefix: only the last message, an assistant's, can be continued", param="messages"
            )
    last = messages[-1]
    if isinstance(last, dict) and last.get("prefix") is True:
        return [*messages[:-1], {**last, "wo_eos": True}]
    return messages


def _check_reply_opens(messages: list[dict]) -> None:
    """A chat completion answers the conversation: its prompt must end where the assistant speaks next (after
    a user, developer or tool message, a reminder or a task) or inside an assistant turn left open. After a
    system message or a finished assistant turn the format opens nothing, and the model would only go on
    with a new document."""
    last = messages[-1]
    if last.get("task") is not None:
        return
    if last.get("role") == "system":
        raise APIError(
            400,
            "messages: the last message is a system message, which opens no reply: end with a user or tool message",
            param="messages",
        )
    if last.get("role") == "assistant" and not last.get("wo_eos"):
        raise APIError(
            400,
            "messages: the last message is a finished assistant message, which opens no reply: end with a user "
            "or tool message, or give it `prefix: true` to have the answer continue it",
            param="messages",
        )
