"""Usage over several choices and prompts, and errors, from the items replicas send the ingress."""

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
