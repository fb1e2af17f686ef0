"""Usage over several choices and prompts, and errors, from the items replicas send the ingress."""

import json

import pytest

from deployments.ingress import _from_item, _usage
from deployments.model_server import error_item
from lora_runtime.errors import AdapterNotFoundError, InvalidRequestError


def _item(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "cached_tokens": cached_tokens}


def test_one_choice_carries_its_cached_tokens():
    assert _usage([_item(30, 4, 17)], [0]) == {
        "prompt_tokens": 30,
        "completion_tokens": 4,
        "total_tokens": 34,
        "prompt_tokens_details": {"cached_tokens": 17},
    }


def test_a_prompt_counts_once_with_what_all_its_choices_found_cached():
    # n=3 over one prompt: the second and third choices reused what the first computed.
    use = _usage([_item(30, 4, 0), _item(30, 2, 29), _item(30, 4, 20)], [0, 0, 0])
    assert use["prompt_tokens"] == 30 and use["completion_tokens"] == 10
    assert use["prompt_tokens_details"] == {"cached_tokens": 0}
    both = _usage([_item(30, 4, 17), _item(30, 4, 20)], [0, 0])
    assert both["prompt_tokens_details"] == {"cached_tokens": 17}


def test_several_prompts_add_up():
    # Two prompts, n=2 each: choice index = prompt number * n + sample number.
    items = [_item(30, 1, 16), _item(30, 1, 16), _item(8, 2, 0), _item(8, 2, 0)]
    use = _usage(items, [0, 0, 1, 1])
    assert use["prompt_tokens"] == 38 and use["completion_tokens"] == 6 and use["total_tokens"] == 44
    assert use["prompt_tokens_details"] == {"cached_tokens": 16}


def test_replica_errors_name_the_field_they_concern():
    missing = _from_item(error_item(AdapterNotFoundError("model 'x' is not registered"))["error"])
    assert missing.status_code == 404 and missing.param == "model" and missing.error_type == "not_found_error"
    plain = _from_item(error_item(InvalidRequestError("prompt is too long"))["error"])
    assert plain.status_code == 400 and plain.param is None
    tokens = _from_item(error_item(InvalidRequestError("tokens [300] are outside"), param="tokens")["error"])
    assert tokens.body()["error"] == {"message": "tokens [300] are outside", "type": "invalid_request_error",
                                      "param": "tokens", "code": None}


def test_request_bodies_over_the_cap_are_a_413_before_the_handler():
    """By Content-Length, or chunked with no length, a body over max_request_bytes is refused in
    the OpenAI format and the handler never runs; one under the cap reaches it whole, and so
    does a streaming response's disconnect watch."""
    import asyncio

    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    from deployments.ingress import _BodyLimit

    seen = []
    inner = FastAPI()

    @inner.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        seen.append(len(body))
        return {"bytes": len(body)}

    @inner.post("/stream")
    async def stream(request: Request):
        await request.body()

        async def parts():
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(parts(), media_type="text/event-stream")

    limited = _BodyLimit(inner)
    limited.max_bytes = 1000

    async def chunks(n: int, size: int):
        for _ in range(n):
            yield b"x" * size

    async def run():
        transport = httpx.ASGITransport(app=limited)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            ok = await client.post("/echo", content=b"y" * 1000)
            assert ok.status_code == 200 and ok.json() == {"bytes": 1000}
            chunked = await client.post("/echo", content=chunks(3, 300))
            assert chunked.status_code == 200 and chunked.json() == {"bytes": 900}
            for body in (b"z" * 1001, chunks(5, 300)):
                r = await client.post("/echo", content=body)
                assert r.status_code == 413, r.text
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and "max_request_bytes=1000" in error["message"]
            streamed = await client.post("/stream", content=b"{}")
            assert streamed.status_code == 200 and streamed.text.count("data:") == 3

    asyncio.run(run())
    assert seen == [1000, 900]  # the refused bodies never reached the handler


def _edge_app():
    """A FastAPI app with the ingress's error handlers and one route per request body."""
    from fastapi import FastAPI

    from deployments import ingress
    from deployments.openai_protocol import ChatCompletionRequest, CompletionRequest

    test_app = FastAPI()
    test_app.exception_handlers.update(ingress.app.exception_handlers)

    @test_app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return {"prompts": body.prompts()}

    @test_app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        return {"messages": body.chat_messages()}

    @test_app.get("/v1/adapters")
    async def listed():
        return {}

    @test_app.post("/v1/adapters")
    async def registered():
        return {}

    return test_app


def _post(client, path: str, content: bytes):
    r = client.post(path, content=content, headers={"Content-Type": "application/json"})
    return r.status_code, r.json()["error"]


def test_bodies_that_do_not_parse_are_400s_in_the_openai_format():
    from fastapi.testclient import TestClient

    client = TestClient(_edge_app())
    status, error = _post(client, "/v1/completions", b'{"model": "m", "prompt": ')
    assert status == 400 and "not valid JSON" in error["message"] and error["type"] == "invalid_request_error"
    status, error = _post(client, "/v1/completions", b'{"model": "\xff\xfe", "prompt": "x"}')  # not UTF-8
    assert status == 400 and error["type"] == "invalid_request_error" and "parsing the body" in error["message"]
    for body, param in [
        (b'{"model": "m\\ud800", "prompt": "x"}', "model"),
        (b'{"model": "m", "prompt": ["ok", "\\udc00"]}', "prompt"),
    ]:
        status, error = _post(client, "/v1/completions", body)
        assert status == 400 and error["param"] == param and "lone UTF-16 surrogate" in error["message"], error
    status, error = _post(client, "/v1/chat/completions",
                          b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]}')
    assert status == 400 and error["param"] == "messages" and "messages[0].content" in error["message"]
    # A surrogate pair is one character, and fine.
    r = client.post("/v1/completions", json={"model": "m", "prompt": "\U0001F600"})
    assert r.status_code == 200 and r.json() == {"prompts": ["\U0001F600"]}


@pytest.mark.parametrize("body, param, says", [
    ({"model": "m", "prompt": "x", "max_tokens": "many"}, "max_tokens", "valid integer"),
    ({"prompt": "x"}, "model", "Field required"),
    ({"model": "m", "prompt": ""}, "prompt", "prompt='' is empty"),
    ({"model": "m", "prompt": "x", "stop": ["s"] * 17}, "stop", "stop has 17 strings; at most 16"),
    ({"model": "m", "prompt": "x", "stop": "s" * 257}, "stop", "257 characters; at most 256"),
    ({"model": "m", "prompt": "x", "n": 17}, "n", "n=17"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix", "suffix is not supported"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"model": "m", "prompt": "x", "n": 2, "best_of": 1}, "best_of", "best_of=1 must be in [n=2, 16]"),
])
def test_a_bad_field_is_a_400_naming_it(body, param, says):
    from fastapi.testclient import TestClient

    r = TestClient(_edge_app()).post("/v1/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], error


def test_our_validation_messages_reach_the_client_without_pydantic_prefixes():
    from fastapi.testclient import TestClient

    client = TestClient(_edge_app())
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "suffix": "y"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "suffix is not supported"
    r = client.post("/v1/completions", json={"model": "m", "prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt: prompt='' is empty"


def test_best_of_keeps_each_prompts_likeliest_sequences():
    from deployments.ingress import _best_of

    def seq(text: str, *lps: float) -> list[dict]:
        entries = [{"token": "t", "logprob": lp, "bytes": [], "top_logprobs": []} for lp in lps]
        return [{"text": text, "logprobs": entries[:1]}, {"text": "", "logprobs": entries[1:]}]

    # Two prompts, three candidates each: ranked by mean, not total, log-probability.
    results = [seq("a", -1.0, -1.0), seq("b", -0.5), seq("c", -0.1, -3.0),
               seq("d", -2.0), seq("e", -0.2, -0.2, -0.2), seq("f")]
    best = _best_of(results, 3, 2, keep_logprobs=False)
    assert [items[0]["text"] for items in best] == ["b", "a", "f", "e"]
    assert all(i["logprobs"] is None for items in best for i in items)
    kept = _best_of(results, 3, 1, keep_logprobs=True)
    assert [items[0]["text"] for items in kept] == ["b", "f"] and kept[0] == results[1]


def test_unknown_paths_and_methods_use_the_openai_format():
    from fastapi.testclient import TestClient

    client = TestClient(_edge_app())
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "no endpoint GET /v1/nothing", "type": "not_found_error", "param": None, "code": None}
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == "GET is not a method of /v1/completions; it " \
        "takes POST"
    assert r.headers["allow"] == "POST"
    # A path with several routes names all their methods.
    r = client.delete("/v1/adapters")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"


def test_a_wrong_method_names_the_methods_of_included_routes():
    """Serve's ingress includes the class's routes through a router, which FastAPI keeps as
    one nested node of the app's routes (with the include's prefix): the 405 still names the
    methods."""
    from fastapi import APIRouter, FastAPI
    from fastapi.testclient import TestClient

    from deployments import ingress

    app = FastAPI()
    app.exception_handlers.update(ingress.app.exception_handlers)
    inner, outer = APIRouter(), APIRouter()

    @inner.get("/adapters")
    async def listed():
        return {}

    @inner.post("/adapters")
    async def registered():
        return {}

    outer.include_router(inner, prefix="/v1")
    app.include_router(outer)
    r = TestClient(app).delete("/v1/adapters")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    assert r.json()["error"]["message"] == "DELETE is not a method of /v1/adapters; it takes GET, POST"


def test_serve_refusals_are_503s_with_retry_after():
    from ray.serve.exceptions import BackPressureError

    from deployments.ingress import _unavailable

    full = _unavailable(BackPressureError(num_queued_requests=2, max_queued_requests=2))
    assert full.status_code == 503 and full.code == "overloaded" and full.headers == {"Retry-After": "1"}
    assert "max_queued_requests=2" in full.message
    later = _unavailable(BackPressureError(num_queued_requests=2, max_queued_requests=2, retry_after_s=2.5))
    assert later.headers == {"Retry-After": "3"}


def test_the_openapi_schema_documents_every_status_and_content_type():
    """Each operation lists the statuses it answers with, in the OpenAI error format (no
    FastAPI 422: bad requests are 400s), and the content types it sends."""
    from deployments.ingress import app

    schema = app.openapi()
    ops = {(m.upper(), path): op for path, item in schema["paths"].items() for m, op in item.items()}
    inference = {"200", "400", "401", "403", "404", "413", "429", "503"}
    expected = {
        ("POST", "/v1/completions"): inference, ("POST", "/v1/chat/completions"): inference,
        ("POST", "/tokenize"): inference, ("POST", "/detokenize"): inference,
        ("GET", "/v1/models"): {"200", "401", "403", "429", "503"},
        ("GET", "/v1/models/{model}"): {"200", "401", "403", "404", "429", "503"},
        ("GET", "/health"): {"200", "503"}, ("GET", "/metrics"): {"200"},
        ("POST", "/v1/adapters"): {"201", "400", "401", "403", "404", "409", "413", "503"},
        ("GET", "/v1/adapters"): {"200", "401", "403", "503"},
    }
    for key, statuses in expected.items():
        assert set(ops[key]["responses"]) == statuses, key
    assert all("422" not in op["responses"] for op in ops.values())
    assert "HTTPValidationError" not in json.dumps(schema)
    error = ops["POST", "/v1/completions"]["responses"]["429"]
    assert error["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "Retry-After" in error["headers"]
    assert set(ops["POST", "/v1/completions"]["responses"]["200"]["content"]) == {"application/json",
                                                                                  "text/event-stream"}
    assert set(ops["GET", "/metrics"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(ops["POST", "/v1/load_lora_adapter"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(ops["POST", "/v1/load_lora_adapter"]["responses"]["400"]["content"]) == {"application/json"}


@pytest.mark.parametrize("cancelled", ["task", "request"])
def test_a_replica_call_cancelled_because_its_client_left_is_a_499_not_an_internal_error(cancelled, caplog):
    """Serve cancels the replica calls of a request whose client closed the connection: the
    ingress answers 499 in the OpenAI format, logs it without an error and does not raise it on
    to the server; any other exception is still a 500 logged with its traceback."""
    import logging

    from fastapi.testclient import TestClient
    from ray.exceptions import TaskCancelledError
    from ray.serve.exceptions import RequestCancelledError

    app = _edge_app()
    error = TaskCancelledError() if cancelled == "task" else RequestCancelledError("r-1")

    @app.get("/cancelled")
    async def cancelled_call():
        raise error

    @app.get("/broken")
    async def broken_call():
        raise TypeError("a bug of ours")

    serve_logger = logging.getLogger("ray.serve")  # Ray's: it does not propagate to the root logger
    serve_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            # Not raised on to the server either (which would log it as a failed request).
            left = TestClient(app, raise_server_exceptions=True).get("/cancelled")
            left_logs = list(caplog.records)
            caplog.clear()
            broken = TestClient(app, raise_server_exceptions=False).get("/broken")
    finally:
        serve_logger.removeHandler(caplog.handler)
    assert left.status_code == 499
    assert left.json()["error"]["code"] == "cancelled" and "client closed" in left.json()["error"]["message"]
    assert not [rec for rec in left_logs if rec.levelno >= logging.WARNING]
    assert any("cancelled: its client left" in rec.getMessage() for rec in left_logs)
    assert broken.status_code == 500 and "a bug of ours" in broken.json()["error"]["message"]
    assert any(rec.levelno == logging.ERROR and rec.exc_info for rec in caplog.records)


def test_known_errors_no_route_converted_are_answered_and_not_raised_on_to_the_server(caplog):
    """A ServingError (raised here, or in a replica and wrapped by Ray) and a replica that died
    reach the app's handlers unconverted: each gets its own status in the OpenAI format, and none
    is raised on to the server, which would log it as a failed request with a traceback."""
    import logging

    from fastapi.testclient import TestClient
    from ray.exceptions import ActorDiedError, RayTaskError

    from lora_runtime.errors import AdapterNotFoundError, AdapterUnavailableError, InvalidRequestError

    app = _edge_app()
    raised = {
        "/bad": InvalidRequestError("temperature must be >= 0", param="temperature"),
        "/wrapped": RayTaskError("generate", "traceback", AdapterNotFoundError("no adapter 'x'")).as_instanceof_cause(),
        "/storage": AdapterUnavailableError("adapter 'y' storage unreachable"),
        "/died": ActorDiedError(),
    }
    for path, error in raised.items():
        app.add_api_route(path, lambda error=error: (_ for _ in ()).throw(error))

    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            client = TestClient(app, raise_server_exceptions=True)  # raised on: the call itself raises
            got = {path: client.get(path) for path in raised}
    finally:
        serve_logger.removeHandler(caplog.handler)
    assert {path: r.status_code for path, r in got.items()} == {"/bad": 400, "/wrapped": 404, "/storage": 503,
                                                                "/died": 503}
    assert got["/bad"].json()["error"]["param"] == "temperature"
    assert got["/wrapped"].json()["error"] == {"message": "no adapter 'x'", "type": "not_found_error", "param": None,
                                               "code": None}
    assert got["/storage"].json()["error"]["code"] == "adapter_unavailable" and got["/storage"].headers["Retry-After"]
    assert got["/died"].json()["error"]["code"] == "replica_failed"
    # The server's side of it, a 503, is a warning without a traceback; a client's mistake is not logged.
    warnings = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert sorted(rec.levelno for rec in warnings) == [logging.WARNING, logging.WARNING]
    assert not any(rec.exc_info for rec in warnings)
    assert any("/storage" in rec.getMessage() for rec in warnings) and any("/died" in rec.getMessage()
                                                                        for rec in warnings)


def test_an_event_stream_cancelled_after_its_start_ends_quietly():
    """When the client of a stream leaves, Serve's receive raises RequestCancelledError past the
    response's start: the stream ends there, and nothing is raised on to the server."""
    from fastapi.testclient import TestClient
    from ray.serve.exceptions import RequestCancelledError

    from deployments.ingress import _EventStream

    app = _edge_app()

    async def events():
        yield "data: 1\n\n"
        raise RequestCancelledError("r-2")

    @app.get("/events")
    async def streamed():
        return _EventStream(events(), media_type="text/event-stream")

    r = TestClient(app, raise_server_exceptions=True).get("/events")
    assert r.status_code == 200 and r.text == "data: 1\n\n"
