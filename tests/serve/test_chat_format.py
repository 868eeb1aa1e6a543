"""The DeepSeek-V4 chat format: the official encoder's vectors byte for byte, the conversation rules, input
validation, and the stream parser (round trips, independence from chunking, malformed markup)."""

import copy
import dataclasses
import json
import random
from pathlib import Path

import pytest

from dsv4.defaults import shipped_model_dir
from dsv4.errors import UserError
from dsv4.serve.chat import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    INVOKE_END,
    INVOKE_START,
    LATEST_REMINDER,
    PARAMETER_END,
    PARAMETER_START,
    TASK_TOKENS,
    THINK_END,
    THINK_START,
    TOKENIZER_SPECIAL_STRINGS,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
    USER,
    ChatFormatError,
    ChatStreamParser,
    ContentDelta,
    ReasoningDelta,
    ToolCall,
    ToolCallEvent,
    encode_chat,
    parse_completion,
    stop_strings,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "chat_encoding"
ASSET_TOKENIZER = shipped_model_dir() / "tokenizer.json"
# How the official test harness encodes each vector (the mode is not stored in the files).
THINKING = {1: True, 2: True, 3: True, 4: False}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]


def vector(n: int) -> tuple[list, list | None, str]:
    data = json.loads((DATA / f"test_input_{n}.json").read_bytes().decode("utf-8"))
    gold = (DATA / f"test_output_{n}.txt").read_bytes().decode("utf-8")
    if isinstance(data, dict):
        return data["messages"], data["tools"], gold
    return data, None, gold


def call(name: str, args: dict, call_id: str = "") -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
    if call_id:
        out["id"] = call_id
    return out


def completion(messages: list, **kw) -> str:
    """The text the model generates for the last (assistant) message: the full encoding minus the prompt."""
    prompt, full = encode_chat(messages[:-1], **kw), encode_chat(messages, **kw)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def coalesce(events: list) -> list:
    """Adjacent deltas of one kind merged: the form in which chunkings must agree."""
    out: list = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, (ContentDelta, ReasoningDelta)):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def stream(text: str, cuts: list[int], thinking: bool) -> tuple[list, object]:
    parser = ChatStreamParser(thinking)
    events, prev = [], 0
    for c in [*cuts, len(text)]:
        events += parser.feed(text[prev:c])
        prev = c
    result = parser.finish()
    return events + result.flushed, result


# ---------------------------------------------------------------- encoding: the reference vectors


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reference_vector_byte_for_byte(n):
    messages, tools, gold = vector(n)
    if tools is not None:  # the official harness puts the request's tools on the system message
        messages[0]["tools"] = tools
    before = copy.deepcopy(messages)
    assert encode_chat(messages, thinking=THINKING[n]) == gold
    assert messages == before  # the caller's messages are not modified


def test_reference_vector_request_level_tools():
    messages, tools, gold = vector(1)
    assert encode_chat(messages, tools=tools, thinking=True) == gold


def test_reference_vector_1_turns_parse_back():
    _, _, gold = vector(1)
    opener = ASSISTANT + THINK_START
    first = gold.index(opener) + len(opener)
    turn = gold[first : gold.index(USER, first)]
    parsed = parse_completion(turn, thinking=True)
    assert parsed.reasoning_content == (
        "The user wants to know the weather in Beijing. I should use the get_weather tool."
    )
    assert parsed.content == ""
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"location": "Beijing", "unit": "celsius"}
    assert parsed.finish_reason == "tool_calls"
    last = parse_completion(gold[gold.rindex(opener) + len(opener) :], thinking=True)
    assert last.reasoning_content == "Got the weather data. Let me format a nice response."
    assert "22°C" in last.content and last.tool_calls == [] and last.finish_reason == "stop"


def test_reference_vector_2_drops_earlier_reasoning_and_parses_back():
    messages, _, gold = vector(2)
    assert "The user said hello" not in gold
    opener = ASSISTANT + THINK_START
    parsed = parse_completion(gold[gold.rindex(opener) + len(opener) :], thinking=True)
    assert parsed.to_message() == {
        "role": "assistant",
        "content": messages[-1]["content"],
        "reasoning_content": messages[-1]["reasoning_content"],
    }


# ---------------------------------------------------------------- encoding: conversation rules


def test_generation_prompt_opens_the_assistant_turn():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert encode_chat(msgs) == f"{BOS}S{USER}Q{ASSISTANT}{THINK_END}"
    assert encode_chat(msgs, thinking=True) == f"{BOS}S{USER}Q{ASSISTANT}{THINK_START}"
    assert encode_chat(msgs, add_bos=False) == f"S{USER}Q{ASSISTANT}{THINK_END}"
    # a conversation that ends with a system message opens nothing
    assert encode_chat(msgs[:1], thinking=True) == f"{BOS}S"


def test_chat_mode_never_renders_reasoning():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert encode_chat(msgs) == f"{BOS}{USER}Q{ASSISTANT}{THINK_END}A{EOS}"


CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "u2"},
    {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
]


def test_thinking_mode_drops_reasoning_before_the_last_user_turn():
    assert encode_chat(CONVERSATION, thinking=True) == (
        f"{BOS}S{USER}u1{ASSISTANT}{THINK_END}a1{EOS}{USER}u2{ASSISTANT}{THINK_START}r2{THINK_END}a2{EOS}"
    )


def test_drop_thinking_off_keeps_every_turns_reasoning():
    kept = (
        f"{BOS}S{USER}u1{ASSISTANT}{THINK_START}r1{THINK_END}a1{EOS}"
        f"{USER}u2{ASSISTANT}{THINK_START}r2{THINK_END}a2{EOS}"
    )
    assert encode_chat(CONVERSATION, thinking=True, drop_thinking=False) == kept
    # tools anywhere in the conversation keep the reasoning too (drop_thinking is ignored)
    with_tools = encode_chat(CONVERSATION, tools=TOOLS[:1], thinking=True)
    tools_block = with_tools[len(f"{BOS}S") : with_tools.index(USER)]
    assert tools_block.startswith("\n\n## Tools\n")
    assert with_tools.replace(tools_block, "") == kept


def test_developer_turns_before_the_last_user_are_removed_in_thinking_mode():
    msgs = [
        {"role": "developer", "content": "D"},
        {"role": "assistant", "content": "A", "reasoning_content": "R"},
        {"role": "user", "content": "U"},
    ]
    # the removed developer turn took the assistant turn's opener with it (as in the official encoder)
    assert encode_chat(msgs, thinking=True) == f"{BOS}A{EOS}{USER}U{ASSISTANT}{THINK_START}"
    assert encode_chat(msgs) == f"{BOS}{USER}D{ASSISTANT}{THINK_END}A{EOS}{USER}U{ASSISTANT}{THINK_END}"
    # the last developer message is the turn being answered
    assert encode_chat(msgs[:1], thinking=True) == f"{BOS}{USER}D{ASSISTANT}{THINK_START}"


def test_tool_results_merge_into_one_user_turn_in_call_order():
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 1}, "c1"), call("add", {"a": 2}, "c2")]},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "x"}}],
        },
        {"role": "user", "content": "and?"},
    ]
    prompt = encode_chat(msgs)
    assert prompt.endswith(
        f"{EOS}{USER}<tool_result>one\n\n[Unsupported image_url]</tool_result>\n\n"
        f"<tool_result>two</tool_result>\n\nand?{ASSISTANT}{THINK_END}"
    )
    assert prompt.count(USER) == 2


def test_consecutive_user_messages_join_unless_the_first_has_a_task():
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
    ]
    assert encode_chat(msgs) == f"{BOS}{USER}a\n\nb\nc{ASSISTANT}{THINK_END}"
    msgs[0]["task"] = "query"
    assert encode_chat(msgs) == f"{BOS}{USER}a{USER}b\nc{ASSISTANT}{THINK_END}"


def test_request_tools_attach_to_the_leading_system_message_or_a_new_one():
    user = {"role": "user", "content": "Q"}
    with_system = encode_chat([{"role": "system", "content": "S"}, user], tools=TOOLS)
    assert with_system == encode_chat([{"role": "system", "content": "S", "tools": TOOLS}, user])
    block = with_system[len(BOS) + 1 : with_system.index(USER)]
    assert block.startswith("\n\n## Tools\n\n") and block.endswith("invoke tool calls.\n")
    schemas = block.split("### Available Tool Schemas\n\n")[1].split("\n\nYou MUST")[0].split("\n")
    assert [json.loads(s) for s in schemas] == [t["function"] for t in TOOLS]
    assert encode_chat([user], tools=TOOLS) == f"{BOS}{block}{USER}Q{ASSISTANT}{THINK_END}"
    # request-level tools replace the message's own (the block appears once)
    replaced = encode_chat([{"role": "system", "content": "S", "tools": TOOLS[1:]}, user], tools=TOOLS)
    assert replaced == with_system and replaced.count("## Tools") == 1


def test_tool_calls_render_as_dsml():
    args = {"city": 'Paris "old"\n', "days": 3, "opts": {"a": [1, None]}, "on": True, "x": 1.5}
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "ok", "tool_calls": [call("get_weather", args), call("add", {})]},
    ]
    assert completion(msgs) == (
        f"ok\n\n{TOOL_CALLS_START}\n"
        f'{INVOKE_START} name="get_weather">\n'
        f'{PARAMETER_START} name="city" string="true">Paris "old"\n{PARAMETER_END}\n'
        f'{PARAMETER_START} name="days" string="false">3{PARAMETER_END}\n'
        f'{PARAMETER_START} name="opts" string="false">{{"a": [1, null]}}{PARAMETER_END}\n'
        f'{PARAMETER_START} name="on" string="false">true{PARAMETER_END}\n'
        f'{PARAMETER_START} name="x" string="false">1.5{PARAMETER_END}\n'
        f"{INVOKE_END}\n"
        f'{INVOKE_START} name="add">\n\n{INVOKE_END}\n'
        f"{TOOL_CALLS_END}{EOS}"
    )


def test_arguments_that_are_not_json_become_one_string_parameter():
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "not json"}}]},
    ]
    assert f'{PARAMETER_START} name="arguments" string="true">not json{PARAMETER_END}' in completion(msgs)


def test_task_tokens():
    q = {"role": "user", "content": "Q", "task": "action"}
    assert encode_chat([q]) == f"{BOS}{USER}Q{ASSISTANT}{THINK_END}{TASK_TOKENS['action']}"
    assert encode_chat([q], thinking=True) == f"{BOS}{USER}Q{ASSISTANT}{THINK_START}{TASK_TOKENS['action']}"
    for task in ("query", "authority", "domain", "read_url"):
        assert encode_chat([{**q, "task": task}], thinking=True) == f"{BOS}{USER}Q{TASK_TOKENS[task]}"
    # the answer to a task carries no reasoning, even in thinking mode
    answered = encode_chat([q, {"role": "assistant", "content": "Search", "reasoning_content": "R"}], thinking=True)
    assert answered == f"{BOS}{USER}Q{ASSISTANT}{THINK_START}{TASK_TOKENS['action']}Search{EOS}"
    # title: after the assistant's turn
    titled = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "task": "title"}]
    assert encode_chat(titled) == f"{BOS}{USER}Q{ASSISTANT}{THINK_END}A{EOS}{TASK_TOKENS['title']}"


def test_latest_reminder_sits_between_turns():
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "latest_reminder", "content": "today"},
        {"role": "assistant", "content": "A"},
    ]
    assert encode_chat(msgs) == f"{BOS}{USER}Q{ASSISTANT}{THINK_END}{LATEST_REMINDER}todayA{EOS}"


def test_reasoning_effort_max_prefixes_thinking_prompts_only():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    plain = encode_chat(msgs, thinking=True)
    maxed = encode_chat(msgs, thinking=True, reasoning_effort="max")
    assert maxed.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert maxed.endswith("no assumption is left unchecked.\n\n" + plain[len(BOS) :])
    for effort in ("low", "medium", "high", None):
        assert encode_chat(msgs, thinking=True, reasoning_effort=effort) == plain
    assert encode_chat(msgs, reasoning_effort="max") == encode_chat(msgs)


def test_response_format_block():
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    expected = (
        f"{BOS}S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        f"{json.dumps(fmt)}{USER}Q{ASSISTANT}{THINK_END}"
    )
    assert encode_chat(msgs, response_format=fmt) == expected
    assert encode_chat([{**msgs[0], "response_format": fmt}, msgs[1]]) == expected
    assert encode_chat(msgs, response_format={"type": "text"}) == encode_chat(msgs)


def test_wo_eos_leaves_the_assistant_turn_open():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Partial", "wo_eos": True}]
    assert encode_chat(msgs, thinking=True) == f"{BOS}{USER}Q{ASSISTANT}{THINK_START}{THINK_END}Partial"


def test_context_renders_only_the_new_messages():
    ctx = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    ]
    new = [{"role": "user", "content": "u2"}]
    # chat mode: the rendering of the context does not depend on what follows
    assert encode_chat(ctx) + encode_chat(new, context=ctx) == encode_chat(ctx + new)
    # thinking mode: the rules apply to the whole conversation, only the new part is returned
    assert encode_chat(new, context=ctx, thinking=True) == f"{USER}u2{ASSISTANT}{THINK_START}"
    assert encode_chat(ctx + new, thinking=True).endswith(f"{THINK_END}a1{EOS}{USER}u2{ASSISTANT}{THINK_START}")
    # a developer turn the drop rule removes from the context does not shift what is rendered
    dev_ctx = [{"role": "developer", "content": "D"}, *ctx[1:]]
    assert encode_chat(new, context=dev_ctx, thinking=True) == f"{USER}u2{ASSISTANT}{THINK_START}"


# ---------------------------------------------------------------- encoding: input validation


BAD_INPUTS = [
    ({"messages": []}, "messages: must not be empty"),
    ({"messages": "hello"}, "messages: must be a list"),
    ({"messages": ["hello"]}, "messages[0]: must be an object"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role: unknown role 'function'"),
    ({"messages": [{"content": "x"}]}, "messages[0].role: unknown role None"),
    ({"messages": [{"role": "user"}]}, "messages[0].content: missing content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: must be a string or a list"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]: only text parts",
    ),
    ({"messages": [{"role": "developer", "content": ""}]}, "messages[0].content: a developer message must not"),
    ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages[0].content: missing content"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "latest_reminder"}]}, "messages[0].content: missing content"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 1}]}, "reasoning_content"),
    ({"messages": [{"role": "user", "content": "x", "task": "summarize"}]}, "messages[0].task: unknown task"),
    ({"messages": [{"role": "assistant", "content": "x", "wo_eos": "yes"}]}, "messages[0].wo_eos"),
    ({"messages": [{"role": "user", "content": "x", "tools": TOOLS}]}, "messages[0].tools: only a system"),
    ({"messages": [{"role": "assistant", "tool_calls": {"a": 1}}]}, "messages[0].tool_calls: must be a list"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "", "arguments": "{}"}}]}]},
        "messages[0].tool_calls[0].function.name",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]},
        "messages[0].tool_calls[0].function.arguments: must be a JSON string",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
        "messages[0].tool_calls[0].function.arguments: must encode a JSON object",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}]},
        "messages[0].tool_calls[0].type",
    ),
    ({"tools": {"name": "f"}}, "tools: must be a list"),
    ({"tools": [{"type": "function"}]}, "tools[0].function: must be an object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type: must be 'function'"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters: must be a JSON Schema object",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": {1, 2}}}}]},
        "tools[0].function: not JSON-serializable",
    ),
    ({"reasoning_effort": "extreme"}, "reasoning_effort: unknown value 'extreme'"),
    ({"response_format": "json"}, "response_format: must be an object"),
    (
        {"messages": [{"role": "system", "content": "S", "response_format": ["x"]}]},
        "messages[0].response_format: must be an object",
    ),
    ({"thinking": "yes"}, "thinking: must be true or false"),
    ({"context": [{"role": "user"}]}, "context[0].content: missing content"),
]


@pytest.mark.parametrize("kwargs,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_a_clear_value_error(kwargs, message):
    kwargs = {"messages": [{"role": "user", "content": "Q"}], **kwargs}
    with pytest.raises(ChatFormatError) as err:
        encode_chat(**kwargs)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, UserError)


# ---------------------------------------------------------------- special strings


def test_special_strings():
    assert stop_strings() == [EOS]
    assert len(set(TOKENIZER_SPECIAL_STRINGS)) == len(TOKENIZER_SPECIAL_STRINGS)
    assert {BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML} <= set(TOKENIZER_SPECIAL_STRINGS)
    assert set(TASK_TOKENS.values()) <= set(TOKENIZER_SPECIAL_STRINGS)
    # the shipped tokenizer's special tokens are exactly the format's BOS and EOS
    added = json.loads(ASSET_TOKENIZER.read_text(encoding="utf-8"))["added_tokens"]
    assert {t["content"] for t in added if t["special"]} == {BOS, EOS}


# ---------------------------------------------------------------- parsing: round trips

PIECES = [
    "a",
    "Z",
    " ",
    "\n",
    "\n\n",
    "<",
    ">",
    "/",
    '"',
    "=",
    "｜",
    "é",
    "中",
    "{",
    "}",
    "\\",
    "DSML",
    DSML,
    "<｜DSML",
    "｜DSML｜tool",
    "tool_calls",
    "</think",
    "<think>",
    "think>",
    "<｜end▁of",
    "sentence｜>",
    "parameter",
    'string="true"',
    INVOKE_END,
    THINK_START,
]


def rand_text(rng: random.Random, forbidden: tuple[str, ...], n: int = 10) -> str:
    while True:
        s = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, n)))
        if not any(f in s for f in forbidden):
            return s


VALUE_FORBIDDEN = (EOS, PARAMETER_END[1:-1])  # a parameter value ends at its closing tag


def rand_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.4:
        return rand_text(rng, VALUE_FORBIDDEN)
    if r < 0.55:
        return rng.randint(-(10**6), 10**6)
    if r < 0.62:
        return rng.uniform(-1e3, 1e3)
    if r < 0.7:
        return rng.choice([True, False, None])
    if depth < 2 and r < 0.85:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2:
        return {rand_text(rng, VALUE_FORBIDDEN, 3): rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return rand_text(rng, VALUE_FORBIDDEN)


def rand_assistant(rng: random.Random, thinking: bool) -> dict:
    msg = {"role": "assistant", "content": rand_text(rng, (EOS, TOOL_CALLS_START))}
    if thinking:
        msg["reasoning_content"] = rand_text(rng, (EOS, THINK_END))
    if rng.random() < 0.6:
        msg["tool_calls"] = []
        for _ in range(rng.randint(1, 3)):
            keys = ["".join(rng.choice("abcxyz_") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 4))]
            args = {k: rand_value(rng) for k in keys}
            msg["tool_calls"].append(call(rng.choice(["get_weather", "add", "run_code"]), args))
    return msg


def test_round_trip_random_messages():
    rng = random.Random(0)
    for i in range(400):
        thinking = i % 2 == 0
        msg = rand_assistant(rng, thinking)
        conv = [{"role": "user", "content": rand_text(rng, ())}, msg]
        text = completion(conv, thinking=thinking, tools=TOOLS)
        result = parse_completion(text, thinking=thinking)
        assert result.to_message() == {k: v for k, v in msg.items() if k != "tool_calls" or v}, text
        assert result.finish_reason == ("tool_calls" if msg.get("tool_calls") else "stop")
        # and through a stream cut at random places
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        events, streamed = stream(text, cuts, thinking)
        assert (streamed.content, streamed.reasoning_content, streamed.tool_calls) == (
            result.content,
            result.reasoning_content,
            result.tool_calls,
        )
        # the parsed message encodes back to the same text
        assert completion([conv[0], result.to_message()], thinking=thinking, tools=TOOLS) == text


def test_round_trip_parameter_value_containing_markup():
    args = {"code": f"print('{TOOL_CALLS_END}{INVOKE_END}<｜DSML｜invoke name=\"x\">')\n", "n": [TOOL_CALLS_END]}
    msg = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [call("run_code", args)]}
    text = completion([{"role": "user", "content": "Q"}, msg], thinking=True)
    assert parse_completion(text, thinking=True).to_message() == msg


def test_content_containing_a_false_block_start_round_trips():
    content = f"use \n\n{TOOL_CALLS_START} to call tools"
    msg = {"role": "assistant", "content": content, "tool_calls": [call("add", {"a": 1})]}
    text = completion([{"role": "user", "content": "Q"}, msg])
    assert parse_completion(text).to_message() == msg


# ---------------------------------------------------------------- parsing: streaming

REASONING_AND_ANSWER = "Think <b>ab</thin k\n</think>Answer <think> \n\n<｜DS x" + EOS + "ignored"
TOOL_TURN = (
    "r</think>Let me check.\n\n"
    + TOOL_CALLS_START
    + "\n"
    + INVOKE_START
    + ' name="get_weather">\n'
    + PARAMETER_START
    + ' name="city" string="true">Pa"ris'
    + PARAMETER_END
    + "\n"
    + PARAMETER_START
    + ' name="days" string="false">[1, 2]'
    + PARAMETER_END
    + "\n"
    + INVOKE_END
    + "\n"
    + INVOKE_START
    + ' name="add">\n\n'
    + INVOKE_END
    + "\n"
    + TOOL_CALLS_END
    + EOS
)
BROKEN_THEN_VALID = (
    "A\n\n"
    + TOOL_CALLS_START
    + "\n"
    + INVOKE_START
    + ' nme="f">\n'
    + INVOKE_END
    + "\n"
    + TOOL_CALLS_END
    + " B\n\n"
    + TOOL_CALLS_START
    + "\n"
    + INVOKE_START
    + ' name="f">\n\n'
    + INVOKE_END
    + "\n"
    + TOOL_CALLS_END
    + "\n<｜end▁of▁"
)
LONG_VALUE = (
    "\n\n"
    + TOOL_CALLS_START
    + "\n"
    + INVOKE_START
    + ' name="run_code">\n'
    + PARAMETER_START
    + ' name="code" string="true">'
    + "for i in range(3):\n    print(i < 2)  # ｜x\n" * 3
    + PARAMETER_END
    + "\n"
    + INVOKE_END
    + "\n"
    + TOOL_CALLS_END
)  # the stream stops right after the block
STREAM_CASES = [(REASONING_AND_ANSWER, True), (TOOL_TURN, True), (BROKEN_THEN_VALID, False), (LONG_VALUE, False)]


@pytest.mark.parametrize("text,thinking", STREAM_CASES, ids=["reasoning", "tools", "broken-then-valid", "long-value"])
def test_every_chunking_gives_the_same_events(text, thinking):
    reference, result = stream(text, [], thinking)
    expected = coalesce(reference)
    assert coalesce(stream(text, list(range(1, len(text))), thinking)[0]) == expected  # one character at a time
    stride = max(1, len(text) // 40)  # every single cut, and pairs of cuts on a grid of about 40 x 40 / 2
    cuts = [[i] for i in range(len(text) + 1)]
    cuts += [[i, j] for i in range(0, len(text) + 1, stride) for j in range(i + 1, len(text) + 1, stride)]
    for c in cuts:
        events, res = stream(text, c, thinking)
        assert coalesce(events) == expected, c
        assert res == dataclasses.replace(result, flushed=res.flushed)


def test_stream_cases_parse_as_intended():
    r = parse_completion(REASONING_AND_ANSWER, thinking=True)
    assert (r.reasoning_content, r.content, r.finish_reason) == (
        "Think <b>ab</thin k\n",
        "Answer <think> \n\n<｜DS x",
        "stop",
    )
    r = parse_completion(TOOL_TURN, thinking=True)
    assert (r.reasoning_content, r.content) == ("r", "Let me check.")
    assert r.tool_calls == [ToolCall("get_weather", '{"city": "Pa\\"ris", "days": [1, 2]}'), ToolCall("add", "{}")]
    events, _ = stream(TOOL_TURN, [], True)
    assert [e for e in events if isinstance(e, ToolCallEvent)] == [
        ToolCallEvent(i, c) for i, c in enumerate(r.tool_calls)
    ]
    r = parse_completion(LONG_VALUE)
    assert r.content == "" and [json.loads(c.arguments)["code"].count("print") for c in r.tool_calls] == [3]
    r = parse_completion(BROKEN_THEN_VALID)
    broken = BROKEN_THEN_VALID[: BROKEN_THEN_VALID.index(" B") + 2]
    assert (r.content, r.tool_calls, r.finish_reason) == (broken + "\n<｜end▁of▁", [ToolCall("f", "{}")], "tool_calls")


def test_text_that_may_start_a_marker_is_held_back():
    p = ChatStreamParser()
    assert p.feed("Hi <") == [ContentDelta("Hi ")]
    assert p.feed("b>") == [ContentDelta("<b>")]
    assert p.feed("x\n") == [ContentDelta("x")]
    assert p.feed("\n<｜DSML｜tool_ca") == []
    assert p.feed("t") == [ContentDelta("\n\n<｜DSML｜tool_cat")]
    assert p.feed(" <｜end▁of▁sent") == [ContentDelta(" ")]
    assert p.feed("ence｜>") == []
    assert p.finish().content == "Hi <b>x\n\n<｜DSML｜tool_cat "
    q = ChatStreamParser(thinking=True)
    assert q.feed("plan </thi") == [ReasoningDelta("plan ")]
    assert q.feed("nk>") == []
    assert q.feed("ok") == [ContentDelta("ok")]


def test_a_block_that_breaks_the_grammar_is_released_at_once():
    p = ChatStreamParser()
    assert coalesce(p.feed(f"A\n\n{TOOL_CALLS_START}\n{INVOKE_START} nme")) == [
        ContentDelta(f"A\n\n{TOOL_CALLS_START}\n{INVOKE_START} nme")
    ]
    assert p.feed("x") == [ContentDelta("x")]


def test_finish_releases_held_text_of_a_truncated_stream():
    p = ChatStreamParser()
    assert p.feed("cut at <｜end") == [ContentDelta("cut at ")]
    result = p.finish()
    assert result.flushed == [ContentDelta("<｜end")] and result.content == "cut at <｜end"
    assert result.finish_reason is None
    assert p.finish().flushed == [] and p.finish().content == result.content  # finish is idempotent


def test_text_after_eos_is_ignored():
    p = ChatStreamParser()
    assert p.feed("done" + EOS + "more") == [ContentDelta("done")]
    assert p.feed("and more") == []
    assert p.finish().content == "done"


def test_thinking_mode_without_end_of_thinking_is_all_reasoning():
    r = parse_completion("still thinking" + EOS, thinking=True)
    assert (r.reasoning_content, r.content, r.finish_reason) == ("still thinking", "", "stop")
    assert parse_completion("x", thinking=False).reasoning_content is None


def test_parser_for_prompt_follows_the_prompts_mode():
    q = [{"role": "user", "content": "Q"}]
    assert ChatStreamParser.for_prompt(encode_chat(q, thinking=True)).thinking
    assert not ChatStreamParser.for_prompt(encode_chat(q)).thinking
    assert not ChatStreamParser.for_prompt(encode_chat([{**q[0], "task": "action"}], thinking=True)).thinking


def test_block_without_blank_line_before_it_still_parses():
    block = f'{TOOL_CALLS_START}\n{INVOKE_START} name="f">\n\n{INVOKE_END}\n{TOOL_CALLS_END}'
    assert parse_completion("x\n" + block).to_message() == {
        "role": "assistant",
        "content": "x\n",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert parse_completion("x" + block + EOS).content == "x"


def test_string_false_values_are_copied_as_written():
    body = (
        f'{INVOKE_START} name="f">\n{PARAMETER_START} name="a" string="false">[1,2 ]{PARAMETER_END}\n'
        f'{PARAMETER_START} name="b" string="true">line\n"q"{PARAMETER_END}\n{INVOKE_END}\n'
    )
    r = parse_completion(f"\n\n{TOOL_CALLS_START}\n{body}{TOOL_CALLS_END}{EOS}")
    assert r.tool_calls == [ToolCall("f", '{"a": [1,2 ], "b": "line\\n\\"q\\""}')]


def block(body: str) -> str:
    return f"\n\n{TOOL_CALLS_START}\n{body}{TOOL_CALLS_END}"


GOOD_PARAM = f'{PARAMETER_START} name="a" string="true">1{PARAMETER_END}\n'
MALFORMED = {
    "bad string flag": block(
        f'{INVOKE_START} name="f">\n{PARAMETER_START} name="a" string="maybe">1{PARAMETER_END}\n{INVOKE_END}\n'
    )
    + EOS,
    "no newline after open": f'\n\n{TOOL_CALLS_START}{INVOKE_START} name="f">\n\n{INVOKE_END}\n{TOOL_CALLS_END}',
    "duplicate parameter": block(f'{INVOKE_START} name="f">\n{GOOD_PARAM}{GOOD_PARAM}{INVOKE_END}\n') + EOS,
    "no name": block(f"{INVOKE_START}>\n\n{INVOKE_END}\n") + EOS,
    "text between invokes": block(f'{INVOKE_START} name="f">\n\n{INVOKE_END}\nthen\n') + EOS,
    "text after parameter": block(f'{INVOKE_START} name="f">\n{GOOD_PARAM[:-1]} x\n{INVOKE_END}\n') + EOS,
    "cut off before the end": f'ok\n\n{TOOL_CALLS_START}\n{INVOKE_START} name="f">\n{GOOD_PARAM}' + EOS,
    "truncated stream": f'ok\n\n{TOOL_CALLS_START}\n{INVOKE_START} name="f">\n{GOOD_PARAM[:30]}',
    "EOS inside a value": f'\n\n{TOOL_CALLS_START}\n{INVOKE_START} name="f">\n{PARAMETER_START} name="a" '
    f'string="true">x{EOS}y{PARAMETER_END}\n{INVOKE_END}\n{TOOL_CALLS_END}',
    "stray closing tags": f"{TOOL_CALLS_END}{INVOKE_END}{PARAMETER_END} text" + EOS,
    "invoke outside a block": f'x\n\n{INVOKE_START} name="f">\n\n{INVOKE_END}\n' + EOS,
}


@pytest.mark.parametrize("text", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_markup_is_returned_as_content(text):
    raw = text.split(EOS)[0]
    for cuts in ([], list(range(1, len(text)))):
        events, r = stream(text, cuts, thinking=False)
        assert (r.content, r.tool_calls) == (raw, [])
        assert r.finish_reason == ("stop" if EOS in text else None)
        assert not any(isinstance(e, ToolCallEvent) for e in events)


def test_malformed_markup_in_reasoning_is_reasoning():
    text = "see " + block(f'{INVOKE_START} name="f">\n\n{INVOKE_END}\n') + THINK_END + "A" + EOS
    r = parse_completion(text, thinking=True)
    assert (r.reasoning_content, r.content, r.tool_calls) == (text.split(THINK_END)[0], "A", [])


def test_an_empty_block_is_markup_without_calls():
    r = parse_completion("A" + block("") + EOS)
    assert (r.content, r.tool_calls, r.finish_reason) == ("A", [], "stop")


def test_tool_call_indices_count_across_blocks():
    one = block(f'{INVOKE_START} name="f">\n\n{INVOKE_END}\n')
    events, r = stream(one + "x" + one + EOS, [], thinking=False)
    assert [e.index for e in events if isinstance(e, ToolCallEvent)] == [0, 1]
    assert r.content == "x" and r.finish_reason == "tool_calls"
