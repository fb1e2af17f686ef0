"""The Responses API's request mapping and output, checked against the openai package's own
types (the shapes its client parses)."""

import asyncio
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from deployments.openai_protocol import OpenAIError, chat_chunk, chat_choice, chat_response, usage, usage_chunk
from deployments.responses_api import ResponseBuilder, ResponsesRequest

TOOLS = [{"type": "function", "name": "add", "description": "a + b",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]


def test_input_items_become_the_chat_a_template_reads():
    r = ResponsesRequest(model="m", instructions="Be terse.", max_output_tokens=7, tools=TOOLS,
                         tool_choice={"type": "function", "name": "add"}, input=[
                             {"role": "user", "content": [{"type": "input_text", "text": "2+"},
                                                          {"type": "input_text", "text": "3?"}]},
                             {"type": "reasoning", "id": "rs_1", "summary": []},
                             {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                             {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 3}'},
                             {"type": "function_call_output", "call_id": "c1", "output": "5"},
                             {"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": "5"}]}])
    chat = r.chat_request()
    assert chat.chat_messages() == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 3}}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
        {"role": "assistant", "content": "5"},
    ]
    assert chat.max_tokens == 7 and chat.tool_request()["choice"] == "add"
    assert chat.tool_request()["tools"][0]["function"]["name"] == "add"
    plain = ResponsesRequest(model="m", input="hi", text={"format": {"type": "json_schema", "name": "s", "schema": {
        "type": "object"}}}, include=["message.output_text.logprobs"], top_logprobs=2, truncation="auto").chat_request()
    assert plain.chat_messages() == [{"role": "user", "content": "hi"}]
    assert plain.guided().kind == "json_schema" and plain.logprobs_wanted() == 2
    assert plain.truncate_prompt_tokens == -1
    assert plain.priority == 0 and ResponsesRequest(model="m", input="hi", priority=-3).chat_request().priority == -3


@pytest.mark.parametrize("body, param, says", [
    ({"input": []}, "input", "input=[] is empty"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input", "input[0].role='wizard'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input_image"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "call_id must be a string"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "hosts no tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "text.format.type='yaml'"),
    ({"input": "x", "text": {"format": "json"}}, "text", "text.format must be an object"),
    ({"input": [{"role": "user", "content": ["hi"]}]}, "input", "input[0].content[0] of type=None"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": {"x": 1}}]}, "input",
     "input[0].output must be a string"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice="),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", "include"),
    ({"input": "x", "max_output_tokens": 2, "text": {"format": {"type": "json_object"}}, "tools": TOOLS,
      "tool_choice": "required"}, "text", "drop response_format"),
])
def test_bad_requests_name_the_responses_field(body, param, says):
    with pytest.raises(OpenAIError, match=says.replace("[", r"\[")) as e:
        ResponsesRequest.model_validate({"model": "m", **body}).chat_request()
    assert e.value.param == param and e.value.status_code == 400


@pytest.mark.parametrize("field, value", [("previous_response_id", "resp_1"), ("conversation", "conv_1"),
                                          ("prompt", {"id": "p"}), ("background", True), ("max_tool_calls", 2)])
def test_what_needs_stored_state_is_refused_by_name(field, value):
    with pytest.raises(ValidationError, match=field):
        ResponsesRequest.model_validate({"model": "m", "input": "x", field: value})
    ResponsesRequest(model="m", input="x", store=True, metadata={"a": "b"}, reasoning={"effort": "low"})


def test_a_whole_response_parses_as_openais_type():
    r = ResponsesRequest(model="ad", input="hi", tools=TOOLS, max_output_tokens=4)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    chat = chat_response("x", "ad", [chat_choice(0, "Sure.", "tool_calls", tool_calls=[call])], usage(5, 3, 2))
    whole = ResponseBuilder(r, "resp_1").from_chat(chat)
    parsed = Response.model_validate(whole)
    assert parsed.output_text == "Sure." and parsed.status == "completed" and parsed.store is False
    assert [o.type for o in parsed.output] == ["message", "function_call"]
    assert parsed.output[1].call_id == "call_1" and parsed.output[1].arguments == '{"a": 1}'
    assert parsed.usage.input_tokens == 5 and parsed.usage.input_tokens_details.cached_tokens == 2
    cut = ResponseBuilder(r, "resp_2").from_chat(chat_response("x", "ad", [chat_choice(0, "abc", "length")],
                                                               usage(5, 4, 0)))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def _events(request: ResponsesRequest, chunks: list[dict]) -> list[dict]:
    async def chat_sse():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    async def run():
        return [e async for e in ResponseBuilder(request, "resp_1").events(chat_sse())]

    events = []
    for sse in asyncio.run(run()):
        kind, data = sse.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        TypeAdapter(ResponseStreamEvent).validate_python(event)  # the openai client's own event types
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_chat_stream_becomes_the_responses_events():
    r = ResponsesRequest(model="ad", input="hi", tools=TOOLS, stream=True)
    created = 1
    chunks = [chat_chunk("x", "ad", created, {"role": "assistant", "content": ""}, None),
              chat_chunk("x", "ad", created, {"content": "Let me "}, None),
              chat_chunk("x", "ad", created, {"content": "add."}, None),
              chat_chunk("x", "ad", created, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                              "function": {"name": "add", "arguments": ""}}]}, None),
              chat_chunk("x", "ad", created, {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}, None),
              chat_chunk("x", "ad", created, {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, None),
              chat_chunk("x", "ad", created, {"content": ""}, "tool_calls"),
              usage_chunk("x", "ad", created, "chat.completion.chunk", usage(5, 9, 0))]
    events = _events(r, chunks)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Let me add." and final.output[1].arguments == '{"a": 1}'
    assert final.usage.output_tokens == 9 and events[12]["arguments"] == '{"a": 1}'


def test_a_stream_cut_by_max_output_tokens_ends_incomplete_and_an_error_ends_it():
    r = ResponsesRequest(model="ad", input="hi", stream=True)
    events = _events(r, [chat_chunk("x", "ad", 1, {"content": "ab"}, "length"),
                         usage_chunk("x", "ad", 1, "chat.completion.chunk", usage(2, 1, 0))])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = _events(r, [chat_chunk("x", "ad", 1, {"content": "ab"}, None),
                         {"error": {"message": "replica died", "type": "server_error", "param": None,
                                    "code": "replica_failed"}}])
    assert failed[-1]["type"] == "error" and failed[-1]["code"] == "replica_failed"


def test_reasoning_becomes_a_reasoning_item_whole_and_streamed():
    r = ResponsesRequest(model="ad", input="2+2?", stream=True)
    chat = chat_response("x", "ad", [chat_choice(0, "4", "stop", reasoning="add them")], usage(5, 3, 0))
    whole = Response.model_validate(ResponseBuilder(r, "resp_1").from_chat(chat))
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "add them" and whole.output_text == "4"
    events = _events(r, [chat_chunk("x", "ad", 1, {"reasoning_content": "add "}, None),
                         chat_chunk("x", "ad", 1, {"reasoning_content": "them"}, None),
                         chat_chunk("x", "ad", 1, {"content": "4"}, "stop"),
                         usage_chunk("x", "ad", 1, "chat.completion.chunk", usage(5, 3, 0))])
    kinds = [e["type"] for e in events]
    assert kinds[:7] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.reasoning_text.delta", "response.reasoning_text.delta",
                         "response.reasoning_text.done", "response.output_item.done"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output[0].content[0].text == "add them" and final.output_text == "4"
