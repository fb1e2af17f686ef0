"""Tool calls: which format a model's chat template writes them in, the grammar that makes
`tool_choice: required` or a named function always produce a call that parses, and the
parsers that turn a model's output into OpenAI `tool_calls` (whole, and as a stream).

Formats (chosen from the chat template, as the models were trained):
- hermes: Qwen2.5/Qwen3 and Hermes, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is a special
  token, absent from the text when special tokens are skipped);
- llama3_json: Llama 3.1+, `{"name": ..., "parameters": {...}}` (after `<|python_tag|>`,
  a special token), several joined by `; `;
- json: a template that knows no tools: the llama3_json shape with "arguments".
"""

from __future__ import annotations

import json
import re
import uuid

from lora_runtime.engine.grammar import GuidedSpec

FORMATS = ("hermes", "mistral", "llama3_json", "json")
# Most calls one answer may hold (parallel_tool_calls): the grammar ends there.
MAX_PARALLEL_CALLS = 8
# Calls are written as compact JSON (json.dumps's separators): no run of whitespace can grow without end.
COMPACT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def tool_format(chat_template: str | None) -> str:
    """The tool-call format a chat template renders (see the module's docstring)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "json"


def _arguments_key(fmt: str) -> str:
    return "parameters" if fmt == "llama3_json" else "arguments"


def _call_schema(fmt: str, tools: list[dict]) -> dict:
    """One call of any of `tools` (OpenAI function tools), in the format's JSON shape."""
    key = _arguments_key(fmt)
    options = [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]},
                       key: t["function"].get("parameters") or {"type": "object", "properties": {}}},
        "required": ["name", key],
        "additionalProperties": False,
    } for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_grammar(fmt: str, tools: list[dict], *, parallel: bool) -> GuidedSpec:
    """The grammar of an output that is one call (or, with `parallel`, 1-MAX_PARALLEL_CALLS) of `tools`:
    `tool_choice` required passes every tool, a named function only that one."""
    schema = _call_schema(fmt, tools)
    if fmt == "mistral":
        array = {"type": "array", "items": schema, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
        return GuidedSpec("grammar", f"start: %json {json.dumps({**array, **COMPACT})}\n", param="tools")
    call = json.dumps({**schema, **COMPACT})
    if fmt == "hermes":
        separator = '"\\n"'
        rules = f'call: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {call}\n'
    else:
        separator = '"; "'
        rules = f"call: %json {call}\n"
    more = f" ({separator} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    rules = f"start: call{more}\n" + rules
    return GuidedSpec("grammar", rules, param="tools")


def with_tools_described(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The messages with a system message describing `tools` and the call format (json), for
    a chat template that renders no tools itself; merged into a first system message."""
    described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    note = ("You can call these functions:\n" + described + "\nTo call one, answer with only a JSON object "
            '{"name": <function name>, "arguments": <its arguments>}.')
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}] + messages[1:]
    return [{"role": "system", "content": note}] + messages


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _openai_call(obj, fmt: str, names: set[str]) -> dict | None:
    """An OpenAI tool call from one parsed call object, or None if it is none."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(_arguments_key(fmt), obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": _call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _json_values(text: str) -> list | None:
    """The JSON values `text` holds back to back (separated by whitespace or `;`), or None."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def parse_tool_calls(fmt: str, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a model's whole output: calls of tools by the names given;
    output that holds none is all content."""
    names = {t["function"]["name"] for t in tools}
    if fmt == "hermes":
        calls = [_openai_call(v[0], fmt, names) if isinstance(v, list) and v else None
                 for v in (_json_values(m.group(1)) for m in _HERMES_CALL.finditer(text))]
        if calls and all(calls):
            content = _HERMES_CALL.sub("", text).strip()
            return content or None, calls
        return text, []
    body = text.strip()
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        body = body.removeprefix(marker).lstrip()
    values = _json_values(body)
    if fmt == "mistral" and values and isinstance(values[0], list):
        values = [v for chunk in values for v in (chunk if isinstance(chunk, list) else [chunk])]
    if values:
        calls = [_openai_call(v, fmt, names) for v in values]
        if all(calls):
            return None, calls
    return text, []


def _starts(fmt: str) -> tuple[str, ...]:
    """What an output that is a tool call begins with (after leading whitespace)."""
    return {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]", "[{"),
            "llama3_json": ("<|python_tag|>", "{"), "json": ("{",)}[fmt]


class ToolCallStream:
    """Splits a streamed output into content deltas and tool calls: text that cannot begin a
    call streams as content at once; an output that begins like one is held and, when it
    ends, parsed into calls (or, if it is none, sent as content)."""

    def __init__(self, fmt: str, tools: list[dict]):
        self.fmt, self.tools = fmt, tools
        self.text = ""
        self.held = None  # None: undecided; True: holding a possible call; False: content
        self.calls: list[dict] = []

    def feed(self, delta: str, finished: bool) -> str:
        """The content to send now for `delta`; at the end, `calls` holds the tool calls."""
        self.text += delta
        if self.held is None:
            head = self.text.lstrip()
            if head:
                starts = _starts(self.fmt)
                if any(head.startswith(s) for s in starts):
                    self.held = True
                elif not any(s.startswith(head) for s in starts):
                    self.held = False
                    return self.text
        if self.held is False:
            return delta
        if not finished:
            return ""
        content, self.calls = parse_tool_calls(self.fmt, self.text, self.tools)
        return content or ""


def chunk_tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI stream deltas of whole calls: each call's id and name, then its arguments."""
    deltas = []
    for i, call in enumerate(calls):
        fn = call["function"]
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                       "function": {"name": fn["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    return deltas
