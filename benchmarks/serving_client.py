"""The serving benchmark's open-loop client: sends a workload's requests at their arrival times
as streamed OpenAI completions to one URL, and records when each one's first and last tokens
came. Bounded: nothing is sent after the workload's last arrival, and whatever has not finished
`drain_s` after it is cancelled and counted as an error."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

import aiohttp

from benchmarks.serving_workload import RequestRecord, WorkItem

_ERROR_BODY_CHARS = 200


def completion_body(item: WorkItem, model: str) -> dict:
    """The streamed, greedy completion request of one work item: exactly max_tokens tokens, special
    ones shown as text (so every token arrives as text, and is timed)."""
    return {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "skip_special_tokens": False, "stream": True,
            "stream_options": {"include_usage": True}}


async def _stream_one(session: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord) -> None:
    usage = None
    done = False
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            record.error = f"http {r.status}: {(await r.read())[:_ERROR_BODY_CHARS]!r}"
            return
        async for raw in r.content:  # one line at a time
            if not raw.startswith(b"data: "):
                continue
            data = raw[len(b"data: "):].strip()
            if data == b"[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                record.error = f"stream error: {event['error'].get('code')}"
                continue
            if any(c.get("text") for c in event.get("choices", [])):
                now = time.perf_counter()
                if record.first_token is None:
                    record.first_token = now
                record.last_token = now
            if event.get("usage"):
                usage = event["usage"]
    if record.error is None and (not done or usage is None or record.first_token is None):
        record.error = "stream ended without tokens, usage and [DONE]"
    elif usage is not None:
        record.completion_tokens = int(usage["completion_tokens"])


async def _run(url: str, items: Sequence[WorkItem], model_of: Callable[[WorkItem], str],
               drain_s: float) -> list[RequestRecord]:
    # aiohttp parses HTTP in C: on a host shared with the server the client should take as little
    # of the cores as it can (at 30 req/s on 2 cores: 2.3 ms of CPU a request, where httpx took 5.4).
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=drain_s + 60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        records: list[RequestRecord] = []

        async def one(item: WorkItem) -> None:
            await asyncio.sleep(max(0.0, start + item.send_at_s - time.perf_counter()))
            record = RequestRecord(sent=time.perf_counter())
            records.append(record)
            try:
                await _stream_one(session, url, completion_body(item, model_of(item)), record)
            except (aiohttp.ClientError, ValueError) as e:  # connection faults, broken JSON in the stream
                record.error = f"{type(e).__name__}: {e}"[:_ERROR_BODY_CHARS]
            except asyncio.CancelledError:
                record.error = "not finished in time"
                raise

        last_send = max((i.send_at_s for i in items), default=0.0)
        tasks = [asyncio.create_task(one(i)) for i in items]
        _, pending = await asyncio.wait(tasks, timeout=last_send + drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return records


def run_workload(url: str, items: Sequence[WorkItem], model_of: Callable[[WorkItem], str],
                 drain_s: float) -> list[RequestRecord]:
    """Sends `items` to `url` open-loop (each at its send_at_s, the model `model_of(item)`) and
    returns one record per request sent."""
    return asyncio.run(_run(url, items, model_of, drain_s))
