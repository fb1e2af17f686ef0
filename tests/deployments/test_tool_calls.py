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


def test_the_stream_splitter_sends_content_at_once_and_holds_calls_to_the_end():
    plain = ToolCallStream("hermes", TOOLS)
    assert [plain.feed(d, f) for d, f in (("Hel", False), ("lo", False), ("!", True))] == ["Hel", "lo", "!"]
    assert plain.calls == []
    held = ToolCallStream("hermes", TOOLS)
    pieces = [" <tool", '_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "\n</tool_call>"]
    assert [held.feed(d, False) for d in pieces] == ["", "", ""]
    assert held.feed("", True) == ""
    _check_calls(held.calls, {"add"})
    deltas = chunk_tool_calls(held.calls)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert json.loads(deltas[1]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    # Held because it began like a call, but is none: sent as content at the end.
    fake = ToolCallStream("json", TOOLS)
    assert fake.feed("{not a call", False) == "" and fake.feed("}", True) == "{not a call}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = EngineConfig(max_batch=6, max_seq_len=1024, max_loras_per_batch=0)
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
