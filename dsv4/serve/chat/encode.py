"""Encoding: OpenAI-style messages to the prompt text of the official DeepSeek-V4 encoder, byte for byte
(the package docstring says how)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .tokens import (
    ASSISTANT,
    BOS,
    EOS,
    INVOKE_END,
    INVOKE_START,
    LATEST_REMINDER,
    MAX_EFFORT_PREFIX,
    PARAMETER_END,
    PARAMETER_START,
    REASONING_EFFORTS,
    RESPONSE_FORMAT_BLOCK,
    ROLES,
    TASK_TOKENS,
    THINK_END,
    THINK_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
    TOOL_RESULT_END,
    TOOL_RESULT_START,
    TOOLS_BLOCK,
    USER,
    ChatFormatError,
)

# ---------------------------------------------------------------- encoding: validated messages


@dataclass
class _Block:
    """One part of a user turn: text, or a tool result (with the id of the call it answers)."""

    kind: str  # "text" | "tool_result"
    text: str
    call_id: str = ""


@dataclass
class _Turn:
    """A validated message. `blocks` is used by user turns, `content` by every other role."""

    role: str
    content: str = ""
    blocks: list[_Block] = field(default_factory=list)
    tools: list[dict] | None = None  # function schemas (the "function" objects)
    response_format: Any = None
    reasoning: str | None = None
    tool_calls: list[tuple[str, str, dict]] = field(default_factory=list)  # (id, name, arguments)
    call_id: str = ""  # tool messages: the call they answer
    task: str | None = None
    wo_eos: bool = False


def _to_json(value: Any, where: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ChatFormatError(f"{where}: not JSON-serializable ({e})") from None


def _text(value: Any, where: str, *, required: bool) -> str | None:
    """A string, or a list of {"type": "text", "text": ...} parts joined with newlines."""
    if value is None:
        if required:
            raise ChatFormatError(f"{where}: missing content")
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': str}}) are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatFormatError(f"{where}: must be a string or a list of text parts, not {type(value).__name__}")


def _tool_result_text(value: Any, where: str) -> str:
    """A tool message's content: a string, or parts whose texts are joined with blank lines (a part of any
    other type shows as `[Unsupported <type>]`, as the official encoder renders it)."""
    if value is None:
        raise ChatFormatError(f"{where}: missing content")
    if isinstance(value, str):
        return value
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise ChatFormatError(f"{where}: must be a string or a list of content parts, not {type(value).__name__}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise ChatFormatError(f"{where}[{j}]: a content part must be an object with a 'type'")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}[{j}].text: must be a string")
            texts.append(part["text"])
        else:
            texts.append(f"[Unsupported {part['type']}]")
    return "\n\n".join(texts)


def _tool_schemas(tools: Any, where: str) -> list[dict]:
    """OpenAI tools ([{"type": "function", "function": {"name", "description", "parameters"}}]) ->
    the function objects, unchanged (they are rendered as given)."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ChatFormatError(f"{where}: must be a list of tools")
    out = []
    for j, tool in enumerate(tools):
        w = f"{where}[{j}]"
        if not isinstance(tool, Mapping):
            raise ChatFormatError(f"{w}: must be an object")
        if tool.get("type") != "function":
            raise ChatFormatError(f"{w}.type: must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ChatFormatError(f"{w}.function: must be an object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatFormatError(f"{w}.function.name: must be a non-empty string")
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise ChatFormatError(f"{w}.function.description: must be a string")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], Mapping):
            raise ChatFormatError(f"{w}.function.parameters: must be a JSON Schema object")
        _to_json(fn, f"{w}.function")
        out.append(dict(fn))
    return out


def _response_format(value: Any, where: str) -> dict | None:
    """An OpenAI response_format object; {"type": "text"} (the default) means none."""
    if not isinstance(value, Mapping):
        raise ChatFormatError(f"{where}: must be an object")
    _to_json(value, where)
    return None if value.get("type") == "text" else dict(value)


def check_tools(tools: Any) -> None:
    """Raise ChatFormatError for OpenAI tool definitions the format cannot encode (`encode_chat` checks those
    it renders; a request may carry tools it does not render)."""
    _tool_schemas(tools, "tools")


def _call_arguments(arguments: Any, where: str) -> dict:
    """A tool call's JSON arguments as the object whose entries become DSML parameters. Text that is not
    JSON at all is kept whole as one string parameter named "arguments" (as the official encoder does)."""
    if not isinstance(arguments, str):
        raise ChatFormatError(f"{where}: must be a JSON string, not {type(arguments).__name__}")
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    if not isinstance(value, dict):
        raise ChatFormatError(f"{where}: must encode a JSON object, got {type(value).__name__}")
    return value


def _tool_calls(calls: Any, where: str) -> list[tuple[str, str, dict]]:
    if calls is None:
        return []
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ChatFormatError(f"{where}: must be a list")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise ChatFormatError(f"{w}: must be an object")
        if call.get("type", "function") != "function":
            raise ChatFormatError(f"{w}.type: must be 'function', got {call.get('type')!r}")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ChatFormatError(f"{w}.function: must be an object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatFormatError(f"{w}.function.name: must be a non-empty string")
        call_id = call.get("id") or fn.get("id") or ""
        if not isinstance(call_id, str):
            raise ChatFormatError(f"{w}.id: must be a string")
        out.append((call_id, fn["name"], _call_arguments(fn.get("arguments"), f"{w}.function.arguments")))
    return out


def _turn(msg: Any, where: str) -> _Turn:
    """Validate one OpenAI-style message."""
    if not isinstance(msg, Mapping):
        raise ChatFormatError(f"{where}: must be an object with a 'role'")
    role = msg.get("role")
    if role not in ROLES:
        raise ChatFormatError(f"{where}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    task = msg.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise ChatFormatError(f"{where}.task: unknown task {task!r} (expected one of {', '.join(TASK_TOKENS)})")
    wo_eos = msg.get("wo_eos", False)
    if not isinstance(wo_eos, bool):
        raise ChatFormatError(f"{where}.wo_eos: must be true or false")
    for key in ("tools", "response_format"):
        if msg.get(key) is not None and role not in ("system", "developer"):
            raise ChatFormatError(f"{where}.{key}: only a system or developer message can carry {key}")
    turn = _Turn(role=role, task=task, wo_eos=wo_eos)
    if msg.get("tools") is not None:
        turn.tools = _tool_schemas(msg["tools"], f"{where}.tools")
    if msg.get("response_format") is not None:
        turn.response_format = _response_format(msg["response_format"], f"{where}.response_format")
    content = msg.get("content")
    if role == "system":
        turn.content = _text(content, f"{where}.content", required=False) or ""
    elif role in ("user", "latest_reminder"):
        turn.content = _text(content, f"{where}.content", required=True)
    elif role == "developer":
        turn.content = _text(content, f"{where}.content", required=True)
        if not turn.content:
            raise ChatFormatError(f"{where}.content: a developer message must not be empty")
    elif role == "tool":
        turn.content = _tool_result_text(content, f"{where}.content")
        call_id = msg.get("tool_call_id") or ""
        if not isinstance(call_id, str):
            raise ChatFormatError(f"{where}.tool_call_id: must be a string")
        turn.call_id = call_id
    else:  # assistant
        turn.content = _text(content, f"{where}.content", required=False) or ""
        reasoning = msg.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatFormatError(f"{where}.reasoning_content: must be a string")
        turn.reasoning = reasoning
        turn.tool_calls = _tool_calls(msg.get("tool_calls"), f"{where}.tool_calls")
    return turn


# ---------------------------------------------------------------- encoding: conversation rules


def _merge_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """There is no tool role in the prompt: a tool result joins the user turn before it (or starts one),
    and a user message joins a preceding user turn unless that turn carries a task."""
    out: list[_Turn] = []
    for t in turns:
        if t.role == "tool":
            block = _Block("tool_result", t.content, t.call_id)
            if out and out[-1].role == "user":
                out[-1].blocks.append(block)
            else:
                out.append(_Turn("user", blocks=[block]))
        elif t.role == "user":
            block = _Block("text", t.content)
            if out and out[-1].role == "user" and out[-1].task is None:
                out[-1].blocks.append(block)
            else:
                out.append(_Turn("user", blocks=[block], task=t.task))
        else:
            out.append(t)
    return out


def _order_tool_results(turns: list[_Turn]) -> None:
    """Reorder the tool results inside each user turn as the latest assistant message ordered its calls
    (results for unknown ids sort as if they answered the first call; other blocks keep their places)."""
    order: dict[str, int] = {}
    for t in turns:
        if t.role == "assistant" and t.tool_calls:
            order = {call_id: j for j, (call_id, _, _) in enumerate(t.tool_calls) if call_id}
        elif t.role == "user":
            results = [b for b in t.blocks if b.kind == "tool_result"]
            if len(results) > 1 and order:
                results.sort(key=lambda b: order.get(b.call_id, 0))
                it = iter(results)
                t.blocks = [next(it) if b.kind == "tool_result" else b for b in t.blocks]


def _last_user_index(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _drop_old_reasoning(turns: list[_Turn]) -> list[_Turn]:
    """Before the last user/developer turn: assistant turns lose their reasoning, developer turns go."""
    last = _last_user_index(turns)
    out = []
    for i, t in enumerate(turns):
        if i >= last or t.role in ("user", "system", "latest_reminder"):
            out.append(t)
        elif t.role == "assistant":
            out.append(replace(t, reasoning=None))
    return out


def _dsml_tool_calls(calls: list[tuple[str, str, dict]]) -> str:
    invokes = []
    for _, name, arguments in calls:
        params = []
        for key, value in arguments.items():
            is_str = isinstance(value, str)
            text = value if is_str else json.dumps(value, ensure_ascii=False)
            params.append(
                f'{PARAMETER_START} name="{key}" string="{"true" if is_str else "false"}">{text}{PARAMETER_END}'
            )
        invokes.append(f'{INVOKE_START} name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_END}")
    return f"\n\n{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _instructions(t: _Turn) -> str:
    """The tools and response-format blocks a system or developer turn appends to its content."""
    out = ""
    if t.tools:
        schemas = "\n".join(json.dumps(s, ensure_ascii=False) for s in t.tools)
        out += "\n\n" + TOOLS_BLOCK.format(schemas=schemas)
    if t.response_format:
        out += "\n\n" + RESPONSE_FORMAT_BLOCK.format(schema=json.dumps(t.response_format, ensure_ascii=False))
    return out


def _render(i: int, turns: list[_Turn], thinking: bool, drop_thinking: bool, effort: str | None) -> str:
    """Turn i of the (merged, possibly reasoning-dropped) conversation, plus what opens the next turn."""
    t = turns[i]
    last_user = _last_user_index(turns)
    out = MAX_EFFORT_PREFIX if i == 0 and thinking and effort == "max" else ""
    if t.role == "system":
        out += t.content + _instructions(t)
    elif t.role == "developer":
        out += USER + t.content + _instructions(t)
    elif t.role == "user":
        out += USER + "\n\n".join(
            b.text if b.kind == "text" else f"{TOOL_RESULT_START}{b.text}{TOOL_RESULT_END}" for b in t.blocks
        )
    elif t.role == "latest_reminder":
        out += LATEST_REMINDER + t.content
    else:  # assistant
        answers_task = i > 0 and turns[i - 1].task is not None
        if thinking and not answers_task and (not drop_thinking or i > last_user):
            out += (t.reasoning or "") + THINK_END
        out += t.content
        if t.tool_calls:
            out += _dsml_tool_calls(t.tool_calls)
        if not t.wo_eos:
            out += EOS

    # A turn followed by anything but an assistant or reminder turn opens nothing.
    if i + 1 < len(turns) and turns[i + 1].role not in ("assistant", "latest_reminder"):
        return out
    if t.task == "action":
        out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS["action"]
    elif t.task is not None:
        out += TASK_TOKENS[t.task]
    elif t.role in ("user", "developer"):
        opens_thinking = thinking and (not drop_thinking or i >= last_user)
        out += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return out


def _turns(messages: Any, where: str) -> list[_Turn]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatFormatError(f"{where}: must be a list of messages")
    return [_turn(m, f"{where}[{i}]") for i, m in enumerate(messages)]


def encode_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    *,
    response_format: Mapping[str, Any] | None = None,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    context: Sequence[Mapping[str, Any]] | None = None,
    add_bos: bool = True,
) -> str:
    """Encode OpenAI-style chat messages into a DeepSeek-V4 prompt, exactly as the official encoder does.

    messages: dicts with a `role` (system, user, assistant, tool, developer, latest_reminder) and
        `content`: a string, or a list of {"type": "text", "text": ...} parts joined with newlines (a tool
        message's parts are joined with blank lines, as the official encoder does). Assistant messages
        may carry `reasoning_content` and `tool_calls` ([{"id", "type": "function", "function": {"name",
        "arguments": JSON object as a string}}]); tool messages `tool_call_id`; system/developer messages
        `tools` and `response_format`; any message `task` (one of TASK_TOKENS) and assistant messages
        `wo_eos`. Other keys are ignored.
    tools: OpenAI tool definitions for the request. They are attached to the leading system or developer
        message (replacing tools it carries), or to a new empty system message put first.
    thinking: thinking mode: the prompt ends with `<｜Assistant｜><think>` instead of `...</think>`.
    response_format: a schema the reply must follow, attached like `tools` (None or {"type": "text"}
        adds nothing).
    reasoning_effort: None or one of REASONING_EFFORTS; "max" (in thinking mode) prefixes the prompt with
        the maximum-effort instruction, the others leave it unchanged.
    drop_thinking: in thinking mode, drop the reasoning of turns before the last user message (ignored when
        any message carries tools).
    context: messages already encoded before `messages`: only `messages` are rendered (no BOS), with the
        conversation rules applied to the whole.
    add_bos: start the prompt with BOS (only when there is no context).

    Returns the prompt text. Raises ChatFormatError (a ValueError) for input the format cannot encode.
    """
    if not isinstance(thinking, bool):
        raise ChatFormatError("thinking: must be true or false")
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ChatFormatError(
            f"reasoning_effort: unknown value {reasoning_effort!r} (expected one of {', '.join(REASONING_EFFORTS)})"
        )
    turns = _turns(messages, "messages")
    if not turns:
        raise ChatFormatError("messages: must not be empty")
    ctx = _turns(context, "context") if context is not None else []

    request_tools = _tool_schemas(tools, "tools") if tools is not None else None
    request_format = _response_format(response_format, "response_format") if response_format is not None else None
    if request_tools or request_format:
        head_list = ctx if ctx else turns
        if head_list[0].role not in ("system", "developer"):
            head_list.insert(0, _Turn("system"))
        if request_tools:
            head_list[0].tools = request_tools
        if request_format:
            head_list[0].response_format = request_format

    ctx = _merge_tool_results(ctx)
    turns = _merge_tool_results(turns)
    full = ctx + turns
    _order_tool_results(full)
    drop = drop_thinking and not any(t.tools for t in full)
    if thinking and drop:
        kept = _drop_old_reasoning(full)
        start = len(_drop_old_reasoning(ctx))
        full = kept
    else:
        start = len(ctx)

    prompt = BOS if add_bos and not ctx else ""
    for i in range(start, len(full)):
        prompt += _render(i, full, thinking, drop, reasoning_effort)
    return prompt
