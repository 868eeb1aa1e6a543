"""Decoding: generated text, in chunks cut anywhere, back to reasoning, content and tool calls (the package
docstring says how)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from .tokens import (
    EOS,
    INVOKE_END,
    INVOKE_START,
    PARAMETER_END,
    PARAMETER_START,
    THINK_END,
    THINK_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
)

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
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls
            ]
        return msg


# ---------------------------------------------------------------- decoding: the tool-call block


_NAME_RE = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)  # after INVOKE_START
_PARAM_RE = re.compile(r' name="(.*?)" string="(true|false)">(.*?)<\n?', re.DOTALL)  # up to "/｜DSML｜parameter"
_INVOKE_CLOSE = INVOKE_END[:-1]  # "</｜DSML｜invoke": the ">" belongs to the next separator
_PARAM_CLOSE = PARAMETER_END[1:-1]  # "/｜DSML｜parameter": the "<" ends the value, the ">" is a separator

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
    items = (
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False) if s == 'true' else v}"
        for k, (v, s) in params.items()
    )
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
        self.text = ""  # received text from the start of the segment being read
        self.pending: list[str] = []  # pieces received since `text` was last extended
        self.tail = ""  # the last characters received: a marker may straddle two pieces
        self.search = 0  # in `text`: where the search for the segment's end marker resumes
        self.name = ""
        self.params: dict[str, tuple[str, str]] = {}
        self.calls: list[ToolCall] = []
        self.rest = ""  # once complete: the text after TOOL_CALLS_END

    def _viable(self, seg: str) -> bool:
        """Could a segment that starts with `seg` (its first characters; no end marker found yet) still
        become a valid segment?"""
        stops, exact = _STAGES[self.stage]
        if exact is not None:
            if len(seg) <= len(exact):
                return exact.startswith(seg)
            rest = seg[len(exact) :]
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
            self.stage = {
                INVOKE_START: "name",
                PARAMETER_START: "param",
                _PARAM_CLOSE: "after_param",
                _INVOKE_CLOSE: "after_invoke",
            }[stop]


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
        self._state = "reasoning" if thinking else "content"  # or "tools", "done"
        self._buf = ""  # text received and not yet emitted or consumed (given to the block)
        self._block: _ToolBlockReader | None = None
        self._block_prefix = ""  # "\n\n" + TOOL_CALLS_START, or TOOL_CALLS_START, of the open block
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
            flushed=events,
        )
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
                held = 0 if final else _held_length(self._buf, _CONTENT_HELD if not reasoning else _REASONING_MARKERS)
                self._emit(events, kind, self._buf[: len(self._buf) - held])
                self._buf = self._buf[len(self._buf) - held :]
                if final:
                    self._state = "done"
                return
            before, self._buf = self._buf[:at], self._buf[at + len(marker) :]
            if marker == EOS:
                self._emit(events, kind, before)
                self._saw_eos, self._state = True, "done"
            elif marker == THINK_END:
                self._emit(events, kind, before)
                self._state = "content"
            else:  # a tool-call block starts
                gap = "\n\n" if before.endswith("\n\n") else ""
                self._emit(events, kind, before[: len(before) - len(gap)])
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
