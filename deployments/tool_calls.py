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

from lora_runtime.engine.grammar import JSON_COMPACT, GuidedSpec

FORMATS = ("hermes", "mistral", "llama3_json", "json")
# Most calls one answer may hold (parallel_tool_calls): the grammar ends there.
MAX_PARALLEL_CALLS = 8
# Calls are written as compact JSON, as response_format's JSON is.
COMPACT = {"x-guidance": JSON_COMPACT}
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
        except json.JSONDecodeError:
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
        except json.JSONDecodeError:
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


# The head of one call as every format writes it: its name, then its arguments' key.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _value_prefix(text: str, start: int) -> tuple[str, bool]:
    """The JSON value beginning at text[start] as far as the text goes, and whether it is
    whole (its brackets balanced, strings read with their escapes)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[start:i + 1], True
    return text[start:], False


class ToolCallStream:
    """Splits a streamed output into content and tool-call deltas as OpenAI streams them.

    Content streams at once until a call can begin there (at the start; in hermes, at any
    `<tool_call>`); text that could still be the start of one is held. A call streams as
    soon as its name is whole (its id, type and name), then its arguments piece by piece as
    the model writes them. At the end the whole output is parsed: calls that were not
    streamed (their keys in another order) are sent whole, and held text that was no call
    is sent as content."""

    def __init__(self, fmt: str, tools: list[dict]):
        self.fmt, self.tools = fmt, tools
        self._names = {t["function"]["name"] for t in tools}
        self.text = ""
        self._sent = 0  # characters of text sent as content
        self._calls_at: int | None = None  # where the calls begin in text, once known
        self._plain = False  # no call can begin any more: all of it is content
        self._streamed: list[dict] = []  # per call: {"id", "name", "arguments" (sent so far), "whole"}
        self.calls: list[dict] = []  # at the end: the answer's tool calls

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now) for `delta`; at the end,
        `calls` holds the answer's tool calls."""
        self.text += delta
        content = self._content(finished)
        deltas = self._call_deltas() if self._calls_at is not None else []
        if finished:
            more_content, more = self._finish()
            content, deltas = content + more_content, deltas + more
        return content, deltas

    def _content(self, finished: bool) -> str:
        if self._calls_at is not None:
            return ""
        text, sent = self.text, self._sent
        if self._plain:
            self._sent = len(text)
            return text[sent:]
        if self.fmt == "hermes":
            at = text.find("<tool_call>", sent)
            if at >= 0:
                self._calls_at, self._sent = at, at
                return text[sent:at]
            keep = 0 if finished else held_tail(text, "<tool_call>")
            self._sent = len(text) - keep
            return text[sent:self._sent]
        head = text.lstrip()
        starts = _starts(self.fmt)
        if any(head.startswith(s) for s in starts):
            self._calls_at = 0
            return ""
        if (head and not any(s.startswith(head) for s in starts)) or finished:
            self._plain, self._sent = True, len(text)
            return text[sent:]
        return ""

    def _call_deltas(self) -> list[dict]:
        deltas, at, index = [], self._calls_at, -1
        while True:
            index += 1
            head = _CALL_HEAD.search(self.text, at)
            if head is None:
                break
            name = json.loads(f'"{head.group(1)}"')
            if name not in self._names:
                break
            if index == len(self._streamed):
                self._streamed.append({"id": _call_id(), "name": name, "arguments": "", "whole": False})
                deltas.append({"tool_calls": [{"index": index, "id": self._streamed[index]["id"], "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
            call = self._streamed[index]
            value, whole = _value_prefix(self.text, head.end())
            if not value.startswith("{"):
                break
            if len(value) > len(call["arguments"]):
                deltas.append({"tool_calls": [{"index": index,
                                               "function": {"arguments": value[len(call["arguments"]):]}}]})
                call["arguments"] = value
            call["whole"] = whole
            if not whole:
                break
            at = head.end() + len(value)
        return deltas

    def _finish(self) -> tuple[str, list[dict]]:
        content, parsed = parse_tool_calls(self.fmt, self.text[self._sent:], self.tools)
        self.calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for c in self._streamed]
        if not self.calls and not parsed:  # held text that was no call
            self._sent = len(self.text)
            return content or "", []
        deltas = chunk_tool_calls(parsed[len(self.calls):], first_index=len(self.calls))
        self.calls += parsed[len(self.calls):]
        return "", deltas


def held_tail(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def chunk_tool_calls(calls: list[dict], first_index: int = 0) -> list[dict]:
    """OpenAI stream deltas of whole calls: each call's id and name, then its arguments."""
    deltas = []
    for i, call in enumerate(calls, start=first_index):
        fn = call["function"]
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                       "function": {"name": fn["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    return deltas
