"""OpenAI's Responses API (``POST /v1/responses``) served by the chat machinery.

A request becomes a chat request: ``instructions`` a system message, ``input`` items messages
(function calls and their outputs the assistant ``tool_calls`` and ``tool`` messages a chat
template reads), function ``tools`` chat tools, ``text.format`` a ``response_format``. The
chat's answer becomes the response's output items (a reasoning item for a reasoning model's
``reasoning_content``, a message with ``output_text``, then one ``function_call`` item per
call), whole or as the Responses stream's typed events.

Nothing is stored: a request that refers to a stored response, conversation or prompt is
refused by name, and every response says ``store: false``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import Field, ValidationError, model_validator

from deployments.openai_protocol import ChatCompletionRequest, FieldError, OpenAIError, _Body, validation_error

# Chat request fields -> the Responses field a client sent them as (for error params).
_PARAM_OF_CHAT = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens",
                  "max_completion_tokens": "max_output_tokens", "tools": "tools", "tool_choice": "tool_choice"}
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(_Body):
    """Body of POST /v1/responses (stateless: store is taken, nothing is kept)."""

    model: str = Field(..., min_length=1, description="Base model name or adapter name.")
    input: str | list[dict] = Field(..., description="A text (one user message) or a list of input items: "
                                    "messages, function_call and function_call_output items.")
    instructions: str | None = Field(None, description="A system message ahead of the input.")
    max_output_tokens: int | None = Field(None, description="Most tokens to generate.")
    temperature: float | None = Field(None, description="0 is greedy. Unset: the model's default, else 1.")
    top_p: float | None = Field(None, description="Unset: the model's default, else 1.")
    stream: bool = False
    tools: list[dict] | None = Field(None, description="Function tools: {type: function, name, description, "
                                     "parameters, strict}.")
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = Field(None, description="{format: {type: text | json_object | json_schema, name, schema, "
                              "strict}}; verbosity is taken and changes nothing.")
    top_logprobs: int | None = Field(None, description="With include message.output_text.logprobs: the n "
                                     "likeliest tokens at each position (0-20).")
    include: list[str] | None = Field(None, description="message.output_text.logprobs adds the output's "
                                      "log-probabilities; other values change nothing.")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto: drop the input's first tokens so it fits with max_output_tokens.")
    priority: int = Field(0, description="Extension (vLLM): as the chat request's priority.")
    # Taken, changing nothing here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    reasoning: dict | None = None
    stream_options: dict | None = None
    background: bool | None = None
    # What needs stored state or hosted tools: refused by name when given.
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    max_tool_calls: int | None = None

    @model_validator(mode="after")
    def _stateless(self):
        for name in ("previous_response_id", "conversation", "prompt"):
            if getattr(self, name) is not None:
                raise FieldError(f"{name} is not supported: this server stores no responses, conversations or "
                                 "prompts; send the whole input", name)
        if self.background:
            raise FieldError("background=true is not supported: this server stores no responses to poll",
                             "background")
        if self.max_tool_calls is not None:
            raise FieldError("max_tool_calls is not supported; parallel_tool_calls=false allows one call",
                             "max_tool_calls")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return _LOGPROBS_INCLUDE in (self.include or ())

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this response is computed as (OpenAIError 400 naming the field)."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "temperature": self.temperature, "top_p": self.top_p,
            "stream": self.stream, "parallel_tool_calls": self.parallel_tool_calls, "priority": self.priority,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if (fmt := (self.text or {}).get("format")) is not None:
            body["response_format"] = _response_format(fmt)
        if self.wants_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        elif self.top_logprobs is not None:
            raise OpenAIError(f"top_logprobs needs include=[{_LOGPROBS_INCLUDE!r}]", param="top_logprobs")
        if self.truncation == "auto":
            body["truncate_prompt_tokens"] = -1
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            error = validation_error(e.errors()[0])
            error.param = responses_param(error.param)
            raise error from None

    def _messages(self) -> list[dict]:
        messages: list[dict] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise OpenAIError("input=[] is empty", param="input")
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            where = f"input[{i}]"
            if kind == "message":
                role = item.get("role")
                if role not in _ROLES:
                    raise OpenAIError(f"{where}.role={role!r} must be one of {', '.join(_ROLES)}", param="input")
                messages.append({"role": role, "content": _text_of(item.get("content"), where)})
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", where), "type": "function",
                        "function": {"name": _string(item, "name", where),
                                     "arguments": _string(item, "arguments", where)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not last.get("tool_call_id"):
                    last.setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                                 "content": _text_of(item.get("output"), where, field="output")})
            elif kind == "reasoning":
                continue  # another model's reasoning summary: nothing of it reaches this model's template
            else:
                raise OpenAIError(f"{where}.type={kind!r} is not supported; input items are messages, "
                                  "function_call and function_call_output", param="input")
        return messages


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat request's field (or a path in it) came from, for an error's
    param."""
    if param is None:
        return None
    head = param.split(".")[0]
    return _PARAM_OF_CHAT.get(head, head)


def _string(item: dict, field: str, where: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise OpenAIError(f"{where}.{field} must be a string", param="input")
    return value


def _text_of(content, where: str, field: str = "content") -> str:
    """A message's text: a string, or its input_text/output_text/text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.{field} must be a string or a list of text parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise OpenAIError(f"{where}.{field}[{j}] of type={kind!r} is not supported; only text", param="input")
        parts.append(part["text"])
    return "".join(parts)


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise OpenAIError(f"tools[{i}].type={tool.get('type')!r} is not supported; only function tools (this "
                          "server hosts no tools)", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f"tool_choice={choice!r} is not supported; none, auto, required or "
                      "{type: function, name}", param="tool_choice")


def _response_format(fmt) -> dict:
    if not isinstance(fmt, dict):
        raise OpenAIError(f"text.format must be an object with a type, not {fmt!r}", param="text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise OpenAIError(f"text.format.type={kind!r} must be text, json_object or json_schema", param="text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The response object of one request, whole (from a chat response) or event by event
    (from a chat stream's chunks)."""

    def __init__(self, request: ResponsesRequest, rid: str):
        self.request = request
        self.id = rid
        self.created_at = int(time.time())

    def response(self, output: list[dict], *, status: str, usage: dict | None,
                 incomplete: str | None = None) -> dict:
        r = self.request
        fmt = (r.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": r.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": r.temperature,
            "text": {"format": fmt}, "tool_choice": r.tool_choice or "auto", "tools": r.tools or [],
            "top_p": r.top_p, "truncation": r.truncation or "disabled", "usage": usage, "user": r.user,
            "metadata": r.metadata or {},
        }

    def from_chat(self, chat: dict) -> dict:
        """The whole response of a chat response (n = 1)."""
        [choice] = chat["choices"]
        message = choice["message"]
        logprobs = (choice.get("logprobs") or {}).get("content") if self.request.wants_logprobs else None
        output = []
        if message.get("reasoning_content") is not None:
            output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content") or not message.get("tool_calls"):
            output.append(_message_item(_new_id("msg"), message.get("content") or "", logprobs, "completed"))
        for call in message.get("tool_calls") or ():
            output.append(_call_item(_new_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        length = choice["finish_reason"] == "length"
        return self.response(output, status="incomplete" if length else "completed", usage=_usage(chat["usage"]),
                             incomplete="max_output_tokens" if length else None)

    async def events(self, chat_sse: AsyncIterator[str]) -> AsyncIterator[str]:
        """The Responses stream's events (SSE with event names) of a chat stream's chunks."""
        sequence = 0

        def event(kind: str, **fields) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        output: list[dict] = []
        calls: dict[int, dict] = {}  # chat tool call index -> its function_call item
        finish, use = None, None

        def close() -> list[str]:
            """Events that finish the items still being written (the message, function calls)."""
            out = []
            for index, item in enumerate(output):
                if item["status"] == "completed":
                    continue
                if item["type"] == "reasoning":
                    out.append(event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
                elif item["type"] == "message":
                    part = item["content"][0]
                    out.append(event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=part["logprobs"] or []))
                    out.append(event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
                else:
                    out.append(event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"]))
                item["status"] = "completed"
                out.append(event("response.output_item.done", output_index=index, item=item))
            return out

        yield event("response.created", response=self.response([], status="in_progress", usage=None))
        yield event("response.in_progress", response=self.response([], status="in_progress", usage=None))
        try:
            async for sse in chat_sse:
                data = sse.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    e = chunk["error"]
                    yield event("error", code=e.get("code") or e.get("type"), message=e["message"],
                                param=e.get("param"))
                    return
                if chunk.get("usage"):
                    use = chunk["usage"]
                for line in self._chunk_events(chunk, event, output, calls, close):
                    yield line
                finish = next((c["finish_reason"] for c in chunk.get("choices") or () if c.get("finish_reason")),
                              finish)
        finally:
            await chat_sse.aclose()  # the chat stream's own end: the replicas' sequences stop, the key is charged
        for line in close():
            yield line
        length = finish == "length"
        final = self.response(output, status="incomplete" if length else "completed",
                              usage=_usage(use) if use else None, incomplete="max_output_tokens" if length else None)
        yield event("response.incomplete" if length else "response.completed", response=final)

    def _chunk_events(self, chunk: dict, event, output: list[dict], calls: dict[int, dict], close) -> list[str]:
        """The events of one chat chunk's text and tool call deltas."""
        lines: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                item = output[-1] if output and output[-1]["type"] == "reasoning" else None
                if item is None:
                    item = _reasoning_item(_new_id("rs"), "", "in_progress")
                    output.append(item)
                    lines.append(event("response.output_item.added", output_index=len(output) - 1,
                                       item={**item, "content": []}))
                item["content"][0]["text"] += delta["reasoning_content"]
                lines.append(event("response.reasoning_text.delta", item_id=item["id"], output_index=len(output) - 1,
                                   content_index=0, delta=delta["reasoning_content"]))
            text = delta.get("content")
            if text:
                if output and output[-1]["type"] == "reasoning":
                    lines += close()  # the reasoning is whole once the answer starts
                message = self._open_message(output)
                if message is None:
                    message = _message_item(_new_id("msg"), "", [] if self.request.wants_logprobs else None,
                                            "in_progress")
                    [part] = message["content"]
                    output.append(message)
                    index = len(output) - 1
                    lines.append(event("response.output_item.added", output_index=index,
                                       item={**message, "content": []}))
                    lines.append(event("response.content_part.added", item_id=message["id"], output_index=index,
                                       content_index=0, part=part))
                part = message["content"][0]
                part["text"] += text
                entries = (choice.get("logprobs") or {}).get("content") or []
                if part["logprobs"] is not None:
                    part["logprobs"] += entries
                lines.append(event("response.output_text.delta", item_id=message["id"],
                                   output_index=output.index(message), content_index=0, delta=text,
                                   logprobs=entries))
            for call in delta.get("tool_calls") or ():
                if call["index"] not in calls:
                    lines += close()  # the text, and the calls before this one, are whole
                    item = _call_item(_new_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
                    calls[call["index"]] = item
                    output.append(item)
                    lines.append(event("response.output_item.added", output_index=len(output) - 1, item=item))
                item = calls[call["index"]]
                piece = (call.get("function") or {}).get("arguments") or ""
                if piece:
                    item["arguments"] += piece
                    lines.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=output.index(item), delta=piece))
        return lines

    @staticmethod
    def _open_message(output: list[dict]) -> dict | None:
        """The message item still being written, if any (the last item, in progress)."""
        last = output[-1] if output else None
        return last if last is not None and last["type"] == "message" and last["status"] == "in_progress" else None


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, logprobs: list[dict] | None, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (chat_usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


__all__ = ["ResponseBuilder", "ResponsesRequest", "responses_param"]
