"""The DeepSeek-V4 chat format: OpenAI-style messages to prompt text, and generated text back to a message.

Encoding (`encode_chat`) reproduces the official DeepSeek-V4 encoder byte for byte:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>

- Thinking mode opens `<think>` after `<｜Assistant｜>`; an assistant turn is then
  `{reasoning}</think>{content}`. Chat mode closes it at once (`<｜Assistant｜></think>`).
- In thinking mode the reasoning of assistant turns before the last user (or developer) message is
  dropped, and developer messages before it are removed, unless `drop_thinking=False` or any message
  carries tools (a tool-using conversation keeps every turn's reasoning).
- Tools are described in a `## Tools` block appended to the leading system (or developer) message;
  the model calls them in `｜DSML｜` markup:

      \\n\\n<｜DSML｜tool_calls>
      <｜DSML｜invoke name="get_weather">
      <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
      <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls><｜end▁of▁sentence｜>

  A parameter whose value is a JSON string is written raw with `string="true"`; any other value is
  written as JSON with `string="false"`.
- Tool results (`role: "tool"`) become `<tool_result>...</tool_result>` blocks of a user turn, merged
  with neighbouring user content ("\\n\\n" between blocks) and ordered as the preceding assistant
  message ordered its calls.
- Also supported as in the official encoder: `latest_reminder` and `developer` roles, the
  `reasoning_effort="max"` prefix, a `response_format` schema block, per-message `task` (the
  quick-instruction tokens), `wo_eos` (an assistant turn left open), and `context` (encode only the
  messages that follow an already-encoded conversation).

Decoding (`ChatStreamParser`, `parse_completion`) takes the text generated after such a prompt, in
chunks cut anywhere, and splits it into reasoning, content and tool calls. Tokenization is not done
here: the module produces and consumes text. A tokenizer should encode each string of
`TOKENIZER_SPECIAL_STRINGS` as its single token when its vocabulary has it as an added token (the
tokenizer shipped with dsv4 has only BOS and EOS; elsewhere the markers are ordinary text and both
directions still work), and generated ids must be decoded with special tokens kept so that the markers
reach the parser. Generation of an assistant turn ends at `stop_strings()`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import UserError

# ---------------------------------------------------------------- special strings

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_START = f"<{DSML}invoke"          # followed by ' name="...">'
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_START = f"<{DSML}parameter"    # followed by ' name="..." string="true|false">'
PARAMETER_END = f"</{DSML}parameter>"
TOOL_RESULT_START = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"

# Quick-instruction task tokens, selected by a message's `task` field.
TASK_TOKENS: dict[str, str] = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# The marker strings a tokenizer should encode as single (special) tokens when it has them.
TOKENIZER_SPECIAL_STRINGS: tuple[str, ...] = (
    BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML, *TASK_TOKENS.values())

ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")
# OpenAI's reasoning_effort values; only "max" changes the prompt (the format has one effort prefix,
# anything lower is the model's default effort).
REASONING_EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")

_TOOLS_BLOCK = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{TOOL_CALLS_START}" block like the following:

{TOOL_CALLS_START}
{INVOKE_START} name="$TOOL_NAME">
{PARAMETER_START} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_END}
...
{INVOKE_END}
{INVOKE_START} name="$TOOL_NAME2">
...
{INVOKE_END}
{TOOL_CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501  (the model was trained on these exact lines)

_RESPONSE_FORMAT_BLOCK = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

_MAX_EFFORT_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
    "\n\n"
)


def stop_strings() -> list[str]:
    """The strings that end an assistant turn: generation stops when one is produced (it is not content)."""
    return [EOS]


class ChatFormatError(UserError, ValueError):
    """A chat request the format cannot encode (unknown role, missing content, bad tool schema, ...).
    The message names the offending field, e.g. `messages[2].tool_calls[0].function.name: ...`."""


# ---------------------------------------------------------------- encoding: validated messages


@dataclass
class _Block:
    """One part of a user turn: text, or a tool result (with the id of the call it answers)."""
    kind: str              # "text" | "tool_result"
    text: str
    call_id: str = ""


@dataclass
class _Turn:
    """A validated message. `blocks` is used by user turns, `content` by every other role."""
    role: str
    content: str = ""
    blocks: list[_Block] = field(default_factory=list)
    tools: list[dict] | None = None                       # function schemas (the "function" objects)
    response_format: Any = None
    reasoning: str | None = None
    tool_calls: list[tuple[str, str, dict]] = field(default_factory=list)  # (id, name, arguments)
    call_id: str = ""                                     # tool messages: the call they answer
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
                raise ChatFormatError(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': str}}) are "
                                      "supported")
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
            params.append(f'{PARAMETER_START} name="{key}" string="{"true" if is_str else "false"}">{text}'
                          f'{PARAMETER_END}')
        invokes.append(f'{INVOKE_START} name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_END}")
    return f"\n\n{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _instructions(t: _Turn) -> str:
    """The tools and response-format blocks a system or developer turn appends to its content."""
    out = ""
    if t.tools:
        schemas = "\n".join(json.dumps(s, ensure_ascii=False) for s in t.tools)
        out += "\n\n" + _TOOLS_BLOCK.format(schemas=schemas)
    if t.response_format:
        out += "\n\n" + _RESPONSE_FORMAT_BLOCK.format(schema=json.dumps(t.response_format, ensure_ascii=False))
    return out


def _render(i: int, turns: list[_Turn], thinking: bool, drop_thinking: bool, effort: str | None) -> str:
    """Turn i of the (merged, possibly reasoning-dropped) conversation, plus what opens the next turn."""
    t = turns[i]
    last_user = _last_user_index(turns)
    out = _MAX_EFFORT_PREFIX if i == 0 and thinking and effort == "max" else ""
    if t.role == "system":
        out += t.content + _instructions(t)
    elif t.role == "developer":
        out += USER + t.content + _instructions(t)
    elif t.role == "user":
        out += USER + "\n\n".join(
            b.text if b.kind == "text" else f"{TOOL_RESULT_START}{b.text}{TOOL_RESULT_END}" for b in t.blocks)
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


def encode_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                thinking: bool = False, *, response_format: Mapping[str, Any] | None = None,
                reasoning_effort: str | None = None, drop_thinking: bool = True,
                context: Sequence[Mapping[str, Any]] | None = None, add_bos: bool = True) -> str:
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
        raise ChatFormatError(f"reasoning_effort: unknown value {reasoning_effort!r} "
                              f"(expected one of {', '.join(REASONING_EFFORTS)})")
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


# ---------------------------------------------------------------- decoding: events and results


@dataclass(frozen=True)
class ToolCall:
    """A tool call read from the model's output: `arguments` is a JSON object as text."""
    name: str
    arguments: str


@dataclass(frozen=True)
class ReasoningDelta:
    """More text of the thinking section."""
    text: str


@dataclass(frozen=True)
class ContentDelta:
    """More text of the answer."""
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A complete tool call; `index` counts the calls of this message from 0."""
    index: int
    call: ToolCall


ChatEvent = ReasoningDelta | ContentDelta | ToolCallEvent


@dataclass
class ChatResult:
    """The whole assistant message once generation ended.

    content: the answer text ("" if none). reasoning_content: the thinking text, None when the parser was
    not in thinking mode. tool_calls: in output order. finish_reason: "tool_calls" when calls were made,
    "stop" when the turn ended with EOS, None when the text simply ran out (the server knows whether that
    was max_tokens or a stop string). flushed: the events `finish()` released (text held back in case
    it began a marker, or an unfinished tool-call block returned as content); a streaming server must
    still send them.
    """
    content: str
    reasoning_content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    flushed: list[ChatEvent] = field(default_factory=list)

    def to_message(self) -> dict[str, Any]:
        """The result as an OpenAI-style assistant message (the form `encode_chat` accepts back)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        return msg


# ---------------------------------------------------------------- decoding: the tool-call block


_NAME_RE = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)                                # after INVOKE_START
_PARAM_RE = re.compile(r' name="(.*?)" string="(true|false)">(.*?)<\n?', re.DOTALL)    # up to "/｜DSML｜parameter"
_INVOKE_CLOSE = INVOKE_END[:-1]         # "</｜DSML｜invoke": the ">" belongs to the next separator
_PARAM_CLOSE = PARAMETER_END[1:-1]      # "/｜DSML｜parameter": the "<" ends the value, the ">" is a separator

# stage -> (the markers that end its segment, the exact text the segment must be, or None)
_STAGES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "open": ((INVOKE_START, TOOL_CALLS_END), "\n"),
    "name": ((PARAMETER_START, _INVOKE_CLOSE), None),
    "param": ((_PARAM_CLOSE,), None),
    "after_param": ((PARAMETER_START, _INVOKE_CLOSE), ">\n"),
    "after_invoke": ((INVOKE_START, TOOL_CALLS_END), ">\n"),
}
_LONGEST_MARKER = max(len(m) for m in (EOS, TOOL_CALLS_END, INVOKE_START, PARAMETER_START, _INVOKE_CLOSE, _PARAM_CLOSE))
_VIABILITY_WINDOW = 64  # a segment's first characters, enough to tell whether it can still be valid


def _arguments_json(params: dict[str, tuple[str, str]]) -> str:
    """DSML parameters -> the arguments JSON text: a string="true" value is quoted as a JSON string, a
    string="false" value is JSON already and is copied as written."""
    items = (f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False) if s == 'true' else v}"
             for k, (v, s) in params.items())
    return "{" + ", ".join(items) + "}"


class _ToolBlockReader:
    """Reads one `<｜DSML｜tool_calls>` block as it arrives, following the official decoder's grammar.

    `push` takes the next piece of the text that follows TOOL_CALLS_START. The reader moves from marker
    to marker and checks each segment between two markers. Every marker contains "｜", so a piece with
    none in or just before it cannot end a segment: it is only stored, and text is joined and searched
    only around markers (a long parameter value streamed in small pieces costs linear time).
    """

    def __init__(self) -> None:
        self.stage = "open"
        self.text = ""          # received text from the start of the segment being read
        self.pending: list[str] = []   # pieces received since `text` was last extended
        self.tail = ""          # the last characters received: a marker may straddle two pieces
        self.search = 0         # in `text`: where the search for the segment's end marker resumes
        self.name = ""
        self.params: dict[str, tuple[str, str]] = {}
        self.calls: list[ToolCall] = []
        self.rest = ""          # once complete: the text after TOOL_CALLS_END

    def _viable(self, seg: str) -> bool:
        """Could a segment that starts with `seg` (its first characters; no end marker found yet) still
        become a valid segment?"""
        stops, exact = _STAGES[self.stage]
        if exact is not None:
            if len(seg) <= len(exact):
                return exact.startswith(seg)
            rest = seg[len(exact):]
            return seg.startswith(exact) and any(s.startswith(rest) for s in stops)
        if self.stage == "name":
            seg = seg.lstrip()
        head = 'name="' if self.stage == "name" else ' name="'
        return head.startswith(seg) or seg.startswith(head)

    def push(self, piece: str) -> str:
        """Take more text: "complete", "partial" (needs more text) or "invalid" (including a block that the
        end of the turn (EOS) cuts off)."""
        window = self.tail + piece
        self.tail = window[-_LONGEST_MARKER:]
        self.pending.append(piece)
        if "｜" not in window and len(self.text) >= _VIABILITY_WINDOW:
            return "partial"
        self.text += "".join(self.pending)
        self.pending.clear()
        text, pos = self.text, 0
        while True:
            stops, exact = _STAGES[self.stage]
            found = [(i, s) for s in (*stops, EOS) if (i := text.find(s, self.search)) >= 0]
            if not found:
                self.text = text[pos:]
                self.search = max(0, len(self.text) - _LONGEST_MARKER + 1)
                return "partial" if self._viable(self.text[:_VIABILITY_WINDOW]) else "invalid"
            at, stop = min(found)
            if stop == EOS:
                return "invalid"
            seg = text[pos:at]
            pos = self.search = at + len(stop)
            if exact is not None and seg != exact:
                return "invalid"
            if self.stage == "name":
                m = _NAME_RE.fullmatch(seg)
                if m is None:
                    return "invalid"
                self.name, self.params = m.group(1), {}
            elif self.stage == "param":
                m = _PARAM_RE.fullmatch(seg)
                if m is None or m.group(1) in self.params:
                    return "invalid"
                self.params[m.group(1)] = (m.group(3), m.group(2))
            if stop == _INVOKE_CLOSE:
                self.calls.append(ToolCall(self.name, _arguments_json(self.params)))
            if stop == TOOL_CALLS_END:
                self.rest = text[pos:]
                return "complete"
            self.stage = {INVOKE_START: "name", PARAMETER_START: "param", _PARAM_CLOSE: "after_param",
                          _INVOKE_CLOSE: "after_invoke"}[stop]


# ---------------------------------------------------------------- decoding: the stream parser


def _find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, None)


def _held_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of a marker (and so must wait)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


_REASONING_MARKERS = (THINK_END, EOS)
_CONTENT_MARKERS = (TOOL_CALLS_START, EOS)
_CONTENT_HELD = ("\n\n" + TOOL_CALLS_START, TOOL_CALLS_START, EOS)


class ChatStreamParser:
    """Splits the text generated after a DeepSeek-V4 prompt into reasoning, content and tool calls.

    Feed the text as it is generated, in chunks cut anywhere (even inside a marker): `feed` returns the
    events the new text completes, `finish` the whole message. The events do not depend on where the
    chunks were cut, except that a delta may arrive in several pieces.

    - In thinking mode (the prompt ended with `<think>`) text up to `</think>` is reasoning; everything
      after it, or all the text in chat mode, is content.
    - EOS ends the message; text after it is ignored.
    - A `<｜DSML｜tool_calls>` block in the content (the "\\n\\n" before it is not content) yields one
      `ToolCallEvent` per call once its closing tag arrives. Its parameters become the arguments JSON
      object: a string="true" value is a JSON string, a string="false" value is copied as written.
    - Text that might be the start of a marker is held back until the next text settles it, so no part
      of a marker is ever emitted as reasoning or content.
    - Malformed tool-call markup never raises: a block that breaks the grammar (or is cut off before its
      closing tag) is content, exactly as written, and the text after its start is read again as content.
      Markup inside the reasoning is reasoning.
    """

    def __init__(self, thinking: bool = False) -> None:
        self.thinking = thinking
        self._state = "reasoning" if thinking else "content"   # or "tools", "done"
        self._buf = ""                  # text received and not yet emitted or consumed (given to the block)
        self._block: _ToolBlockReader | None = None
        self._block_prefix = ""         # "\n\n" + TOOL_CALLS_START, or TOOL_CALLS_START, of the open block
        self._block_text: list[str] = []  # everything after the open block's start, kept to re-read it
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._saw_eos = False
        self._result: ChatResult | None = None

    @classmethod
    def for_prompt(cls, prompt: str) -> ChatStreamParser:
        """A parser for the text generated after `prompt`: in thinking mode iff the prompt opened `<think>`."""
        return cls(thinking=prompt.endswith(THINK_START))

    def feed(self, text: str) -> list[ChatEvent]:
        """Take the next piece of generated text; return the events it completes."""
        if self._state == "done":
            return []
        self._buf += text
        events: list[ChatEvent] = []
        self._advance(events, final=False)
        return events

    def finish(self) -> ChatResult:
        """The generation ended: release held-back text and return the message (again on later calls)."""
        if self._result is not None:
            return replace(self._result, flushed=[])
        events: list[ChatEvent] = []
        if self._state != "done":
            self._advance(events, final=True)
        self._result = ChatResult(
            content="".join(self._content),
            reasoning_content="".join(self._reasoning) if self.thinking else None,
            tool_calls=list(self._calls),
            finish_reason="tool_calls" if self._calls else ("stop" if self._saw_eos else None),
            flushed=events)
        return self._result

    def _emit(self, events: list[ChatEvent], kind: type, text: str) -> None:
        if text:
            (self._reasoning if kind is ReasoningDelta else self._content).append(text)
            events.append(kind(text))

    def _advance(self, events: list[ChatEvent], final: bool) -> None:
        while self._state != "done":
            if self._state == "tools":
                if not self._advance_block(events, final):
                    return
                continue
            reasoning = self._state == "reasoning"
            kind = ReasoningDelta if reasoning else ContentDelta
            at, marker = _find_first(self._buf, _REASONING_MARKERS if reasoning else _CONTENT_MARKERS)
            if marker is None:
                held = 0 if final else _held_length(self._buf, _CONTENT_HELD if not reasoning else
                                                    _REASONING_MARKERS)
                self._emit(events, kind, self._buf[:len(self._buf) - held])
                self._buf = self._buf[len(self._buf) - held:]
                if final:
                    self._state = "done"
                return
            before, self._buf = self._buf[:at], self._buf[at + len(marker):]
            if marker == EOS:
                self._emit(events, kind, before)
                self._saw_eos, self._state = True, "done"
            elif marker == THINK_END:
                self._emit(events, kind, before)
                self._state = "content"
            else:  # a tool-call block starts
                gap = "\n\n" if before.endswith("\n\n") else ""
                self._emit(events, kind, before[:len(before) - len(gap)])
                self._block_prefix = gap + TOOL_CALLS_START
                self._block, self._block_text, self._state = _ToolBlockReader(), [], "tools"

    def _advance_block(self, events: list[ChatEvent], final: bool) -> bool:
        """Inside a tool-call block: False while it waits for more text, True once it completed (its calls
        are emitted) or failed (its opening is content and the text after it is read again as content)."""
        assert self._block is not None
        piece, self._buf = self._buf, ""
        self._block_text.append(piece)
        status = self._block.push(piece)
        if status == "complete":
            for call in self._block.calls:
                events.append(ToolCallEvent(len(self._calls), call))
                self._calls.append(call)
            self._buf = self._block.rest
        elif status == "partial" and not final:
            return False
        else:
            self._emit(events, ContentDelta, self._block_prefix)
            self._buf = "".join(self._block_text)
        self._block, self._block_text, self._state = None, [], "content"
        return True


def parse_completion(text: str, thinking: bool = False) -> ChatResult:
    """Parse a whole generated text at once (what `ChatStreamParser` gives for a single chunk)."""
    parser = ChatStreamParser(thinking)
    parser.feed(text)
    return parser.finish()
