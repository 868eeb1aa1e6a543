"""Request bodies of the OpenAI-compatible API, validated with pydantic, and the OpenAI error shape.

Unknown fields are ignored (as OpenAI's API and vLLM do); known fields are type-checked and range-checked
here or by `SamplingParams`. Fields that dsv4 cannot honour are refused with a 400 naming them, never
silently ignored (e.g. `echo`, `suffix`, `logit_bias`, JSON response formats).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool


def _integer(v: Any) -> Any:
    """JSON integers only: `true` is not 1, "5" is not 5 (an integral float such as 16.0 is taken)."""
    if isinstance(v, bool) or isinstance(v, str):
        raise ValueError(f"must be an integer, got {type(v).__name__} {v!r}"[:120])
    return v


def _number(v: Any) -> Any:
    """JSON numbers only: `true` is not 1.0, "0.5" is not 0.5."""
    if isinstance(v, bool) or isinstance(v, str):
        raise ValueError(f"must be a number, got {type(v).__name__} {v!r}"[:120])
    return v


Int = Annotated[int, BeforeValidator(_integer)]
Float = Annotated[float, BeforeValidator(_number)]
Bool = StrictBool


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    n: Int = 1  # range: dsv4.serve.validate (the server's limit)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions, as vLLM names them
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: Bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool = False
    suffix: str | None = None
    best_of: Int | None = None
    token_healing: Bool = True  # extension: heal text prompts (`dsv4.engine.healing`)


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | Bool | None = None  # DeepSeek's {"type": "enabled"}
    chat_template_kwargs: dict[str, Any] | None = None  # {"thinking": true}, as vLLM passes it


def thinking_requested(req: ChatCompletionRequest) -> bool:
    """Thinking mode from `thinking` ({"type": "enabled"} or a bool) or `chat_template_kwargs.thinking`."""
    t = req.thinking
    if isinstance(t, dict):
        kind = t.get("type")
        if kind not in ("enabled", "disabled", None):
            raise APIError(400, "thinking.type must be 'enabled' or 'disabled'", param="thinking")
        if kind is not None:
            return kind == "enabled"
    elif isinstance(t, bool):
        return t
    kw = req.chat_template_kwargs or {}
    v = kw.get("thinking", kw.get("enable_thinking", False))
    if not isinstance(v, bool):
        raise APIError(400, "chat_template_kwargs.thinking must be true or false", param="chat_template_kwargs")
    return v


def refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream: true", param="stream_options")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (no server-side ranking)", param="best_of")
    else:
        fmt = (req.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(400, f"response_format {fmt!r} is not supported (only 'text')", param="response_format")
        tc = req.tool_choice
        if tc not in (None, "auto", "none"):
            raise APIError(400, "tool_choice: only 'auto' and 'none' are supported", param="tool_choice")
