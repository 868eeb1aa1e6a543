"""The DeepSeek-V4 chat format: OpenAI-style messages to prompt text, and generated text back to a message.

Encoding (`encode_chat`, `chat.encode`) reproduces the official DeepSeek-V4 encoder byte for byte:

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

Decoding (`ChatStreamParser`, `parse_completion`, `chat.parse`) takes the text generated after such a prompt, in
chunks cut anywhere, and splits it into reasoning, content and tool calls. Tokenization is not done
here: the module produces and consumes text. A tokenizer should encode each string of
`TOKENIZER_SPECIAL_STRINGS` as its single token when its vocabulary has it as an added token (the
tokenizer shipped with dsv4 has only BOS and EOS; elsewhere the markers are ordinary text and both
directions still work), and generated ids must be decoded with special tokens kept so that the markers
reach the parser. Generation of an assistant turn ends at `stop_strings()`.
"""

from __future__ import annotations

from .encode import check_tools, encode_chat
from .parse import ChatResult, ChatStreamParser, ContentDelta, ReasoningDelta, ToolCall, ToolCallEvent, parse_completion
from .tokens import (
    ASSISTANT,
    BOS,
    DSML,
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
    TOKENIZER_SPECIAL_STRINGS,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
    TOOL_RESULT_END,
    TOOL_RESULT_START,
    TOOLS_BLOCK,
    USER,
    ChatFormatError,
    stop_strings,
)

__all__ = [
    "ASSISTANT",
    "BOS",
    "ChatFormatError",
    "ChatResult",
    "ChatStreamParser",
    "ContentDelta",
    "DSML",
    "EOS",
    "INVOKE_END",
    "INVOKE_START",
    "LATEST_REMINDER",
    "MAX_EFFORT_PREFIX",
    "PARAMETER_END",
    "PARAMETER_START",
    "REASONING_EFFORTS",
    "RESPONSE_FORMAT_BLOCK",
    "ROLES",
    "ReasoningDelta",
    "TASK_TOKENS",
    "THINK_END",
    "THINK_START",
    "TOKENIZER_SPECIAL_STRINGS",
    "TOOLS_BLOCK",
    "TOOL_CALLS_END",
    "TOOL_CALLS_START",
    "TOOL_RESULT_END",
    "TOOL_RESULT_START",
    "ToolCall",
    "ToolCallEvent",
    "check_tools",
    "USER",
    "encode_chat",
    "parse_completion",
    "stop_strings",
]
