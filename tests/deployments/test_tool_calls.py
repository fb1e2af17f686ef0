"""Tool calls: the format chosen from the chat template, the grammar of tool_choice required
and named functions (a random model under it always writes calls that parse into valid
arguments, in every format), the parsers of whole and streamed outputs."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from deployments.tool_calls import FORMATS, MAX_PARALLEL_CALLS, ToolCallStream, chunk_tool_calls, parse_tool_calls, tool_format, tool_grammar
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from tests.helpers.checkpoints import save_tiny_llama

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "東京"]},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50},
                                         "b": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize(("template", "fmt"), [
    ("{% for m in messages %}{% if m.tool_calls %}<tool_call>\n{{ m.tool_calls }}</tool_call>{% endif %}{% endfor %}",
     "hermes"),  # Qwen2.5 / Qwen3 / Hermes
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{%- if tools %}Environment: ipython\n{%- endif %}<|python_tag|>", "llama3_json"),
    ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "json"),
    (None, "json"),
])
def test_the_format_follows_the_chat_template(template, fmt):
    assert tool_format(template) == fmt


def _check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_parsers_read_what_each_format_writes(fmt):
    key = "parameters" if fmt == "llama3_json" else "arguments"
    calls = [{"name": "add", key: {"a": 1, "b": 2}}, {"name": "get_weather", key: {"city": "Oslo", "unit": "c"}}]
    text = {"hermes": "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls),
            "mistral": "[TOOL_CALLS]" + json.dumps(calls),
            "llama3_json": "<|python_tag|>" + "; ".join(json.dumps(c) for c in calls),
            "json": "; ".join(json.dumps(c) for c in calls)}[fmt]
    content, parsed = parse_tool_calls(fmt, text, TOOLS)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == \
        [(c["name"], c[key]) for c in calls]
    # Plain text, a call of an unknown function and broken JSON are content, not calls.
    for other in ("The weather is fine.", text.replace("add", "sub"), text[:-3]):
        assert parse_tool_calls(fmt, other, TOOLS) == (other, [])


def test_hermes_keeps_the_text_around_calls_as_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = parse_tool_calls("hermes", text, TOOLS)
    assert content == "Let me add." and len(calls) == 1


def _stream(fmt: str, text: str, step: int = 3) -> tuple[list[str], list[list[dict]], ToolCallStream]:
    """Feeds `text` a few characters at a time: (content per feed, tool-call deltas per feed, the splitter)."""
    splitter, contents, deltas = ToolCallStream(fmt, TOOLS), [], []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for k, piece in enumerate(pieces):
        content, calls = splitter.feed(piece, k == len(pieces) - 1)
        contents.append(content)
        deltas.append(calls)
    return contents, deltas, splitter


def _assembled(deltas: list[list[dict]]) -> list[dict]:
    """What an OpenAI client builds from the deltas: per index, id, name and arguments joined."""
    calls: dict[int, dict] = {}
    for d in (d for feed in deltas for d in feed):
        [part] = d["tool_calls"]
        call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
        call["id"] = part.get("id", call["id"])
        call["name"] += part.get("function", {}).get("name", "")
        call["arguments"] += part["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def test_content_streams_at_once_and_calls_stream_their_arguments_as_written():
    contents, deltas, _ = _stream("hermes", "Hello there!")
    assert "".join(contents) == "Hello there!" and not any(deltas) and contents[0] == "Hel"
    call = '{"name": "add", "arguments": {"a": 12, "b": "}\\"{"}}'  # a brace and an escaped quote in a string
    text = f"Let me add.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>\n" \
           '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    contents, deltas, splitter = _stream("hermes", text)
    assert "".join(contents) == "Let me add.\n"
    got = _assembled(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == \
        [("add", {"a": 12, "b": '}"{'}), ("get_weather", {"city": "Oslo", "unit": "c"})]
    assert [c["id"] for c in got] == [c["id"] for c in splitter.calls] and len(set(c["id"] for c in got)) == 2
    # Arguments arrive piece by piece while the model writes them, not at the end.
    feeds_with_arguments = [k for k, feed in enumerate(deltas) if any("id" not in d["tool_calls"][0] for d in feed)]
    assert len(feeds_with_arguments) > 4 and feeds_with_arguments[0] < len(deltas) // 2
    assert [c["function"]["arguments"] for c in splitter.calls] == [c["arguments"] for c in got]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_streams_to_the_calls_the_whole_parse_gives(fmt):
    key = "parameters" if fmt == "llama3_json" else "arguments"
    calls = [{"name": "get_weather", key: {"city": "東京", "unit": "f"}}, {"name": "add", key: {"a": -1, "b": 2}}]
    text = {"hermes": "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls),
            "mistral": json.dumps(calls, ensure_ascii=False),
            "llama3_json": "; ".join(json.dumps(c, ensure_ascii=False) for c in calls),
            "json": "; ".join(json.dumps(c, ensure_ascii=False) for c in calls)}[fmt]
    for step in (1, 4, len(text)):
        contents, deltas, splitter = _stream(fmt, text, step)
        assert "".join(contents) == ""
        whole = parse_tool_calls(fmt, text, TOOLS)[1]
        assert [(c["name"], json.loads(c["arguments"])) for c in _assembled(deltas)] == \
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]
        _check_calls(splitter.calls, {"add", "get_weather"})


def test_held_text_that_is_no_call_is_sent_as_content_at_the_end():
    contents, deltas, splitter = _stream("json", '{"not": "a call"}')
    assert "".join(contents[:-1]) == "" and contents[-1] == '{"not": "a call"}'
    assert not any(deltas) and splitter.calls == []
    # A call of a function the request does not offer is content too.
    text = '{"name": "sub", "arguments": {"a": 1}}'
    contents, deltas, splitter = _stream("json", text)
    assert "".join(contents) == text and not any(deltas)
    # Keys in another order: not streamed, sent whole at the end.
    text = '{"arguments": {"a": 1, "b": 2}, "name": "add"}'
    contents, deltas, splitter = _stream("json", text)
    assert not any(deltas[:-1]) and [c["name"] for c in _assembled(deltas)] == ["add"]
    assert chunk_tool_calls(splitter.calls)[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # Long outputs (up to 1000 tokens), short prompts: prefill steps up to 64 tokens only.
    cfg = EngineConfig(max_batch=6, max_seq_len=1024, max_loras_per_batch=0, max_prefill_tokens=64)
    eng = Engine.from_pretrained(str(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))), cfg).start()
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_and_named_tool_choice_always_parse_into_valid_arguments(engine, fmt):
    """A random-weight model under each format's grammar: tool_choice required (any tool, one
    or more calls) and a named function (that one, once), greedy and sampled."""
    cases = [(TOOLS, True), (TOOLS, False), ([TOOLS[1]], False)]  # required (parallel), required, named
    prompts, params = [], []
    for i, (tools, parallel) in enumerate(cases):
        for sampled in (False, True):
            prompts.append(np.random.default_rng(i).integers(3, engine.model_config.vocab_size, 8).tolist())
            params.append(SamplingParams(max_tokens=1000, temperature=float(sampled), seed=i,
                                         guided=tool_grammar(fmt, tools, parallel=parallel)))
    outs = engine.generate_batch(prompts, params)
    for k, out in enumerate(outs):
        tools, parallel = cases[k // 2]
        assert out.finish_reason == "stop", out.text
        content, calls = parse_tool_calls(fmt, out.text, TOOLS)
        _check_calls(calls, {t["function"]["name"] for t in tools})
        assert content is None
        assert len(calls) <= (MAX_PARALLEL_CALLS if parallel else 1)
