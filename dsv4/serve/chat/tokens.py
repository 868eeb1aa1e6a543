"""The DeepSeek-V4 chat format's special strings, roles and blocks, shared by encoding and decoding."""

from __future__ import annotations

from ...errors import UserError

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
INVOKE_START = f"<{DSML}invoke"  # followed by ' name="...">'
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_START = f"<{DSML}parameter"  # followed by ' name="..." string="true|false">'
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
    BOS,
    EOS,
    USER,
    ASSISTANT,
    LATEST_REMINDER,
    THINK_START,
    THINK_END,
    DSML,
    *TASK_TOKENS.values(),
)

ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")
# OpenAI's reasoning_effort values; only "max" changes the prompt (the format has one effort prefix,
# anything lower is the model's default effort).
REASONING_EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")

TOOLS_BLOCK = f"""## Tools

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

RESPONSE_FORMAT_BLOCK = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

MAX_EFFORT_PREFIX = (
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
