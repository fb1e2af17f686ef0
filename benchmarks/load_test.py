"""Load with a fault, over HTTP: many concurrent streams over many adapters for a while, a
model-server replica killed in the middle, and every answer accounted for.

    python -m benchmarks.load_test [--quick] [--duration S] [--streams N] [--adapters N]

A real Serve deployment on loopback (2 model-server replicas of a small random Llama with
the demo tokenizer, `max_queued_requests` small enough to be reached). Before the load,
each adapter's greedy answer to its prompt is taken alone, one request at a time. Then
`--streams` clients loop for `--duration` seconds, each streaming completions for the
adapters in turn; halfway, one model-server replica is killed (`ray.kill`, so Serve starts
another). Every response is one of:

- `ok`: a whole stream (finish reason, then `[DONE]`) whose text is that adapter's answer;
- `mismatches`: a whole stream with another text (a wrong answer: must be 0);
- `rejected:<code>`: a 429 or 503 in the OpenAI format with `Retry-After` (`overloaded`:
  the queue was full; `replica_failed`: sent to the killed replica), or `rejected:event-<code>`,
  a stream that ended with an error event (the replica it was on died): clean refusals;
- `errors_5xx`: any other 5xx (must be 0);
- `lost`: accepted, then neither a whole answer nor an error: a stream cut off, a request
  that never finished (must be 0).

After the load the replacement replica must be up and every adapter answer again.
`rss_growth_mb` is the ingress's resident memory at the end over after the first quarter
of the load (overload must not pile up in memory). Last line
`requests=<n> errors_5xx=<n> mismatches=<n> rejected=<n> lost=<n> rss_growth_mb=<f>`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time

import httpx

from benchmarks.common import print_table, synthetic_config, write_random_adapter, write_random_checkpoint
from benchmarks.serve_harness import served_app

SHAPE = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256)
NEW_TOKENS = 12
REPLICAS = 2
_RECOVERY_S = 300.0


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _prompt(i: int) -> str:
    return f"adapter {i} says="


async def _one(client: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    """(outcome, text) of one streamed completion; outcome is ok, rejected:<why>, error_5xx or
    lost (the text is compared by the caller). A refusal's why is its error code, with
    `event-` ahead when it came as a stream's error event."""
    text, done, finished, errored = [], False, False, None
    try:
        async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            if r.status_code != 200:
                raw = await r.aread()
                clean = r.status_code in (429, 503) and "retry-after" in r.headers
                try:
                    error = json.loads(raw)["error"]
                    clean = clean and "message" in error
                except (ValueError, KeyError, TypeError):
                    clean = False
                if clean:
                    return f"rejected:{error.get('code')}", raw.decode()[:200]
                return ("error_5xx" if r.status_code >= 500 else "lost"), raw.decode()[:200]
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    errored = event["error"].get("code")
                    continue
                for choice in event.get("choices", []):
                    text.append(choice["text"])
                    finished = finished or choice.get("finish_reason") is not None
    except (httpx.HTTPError, ValueError):
        return "lost", "".join(text)
    if errored is not None:
        return f"rejected:event-{errored}", "".join(text)
    return ("ok" if done and finished else "lost"), "".join(text)


def _ingress_rss_mb() -> float:
    """Resident memory of the ingress replica's process (the cluster is on this host)."""
    from ray._private.state import actors

    [pid] = [a["Pid"] for a in actors(actor_state_name="ALIVE").values()
             if a["ActorClassName"].endswith("OpenAIIngress")]
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def _kill_one_model_server() -> str:
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == "serve" and "LoRAModelServer" in a["name"])
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


async def _load(url: str, bodies: list[dict], expected: list[str], streams: int, duration_s: float,
                kill: bool) -> tuple[collections.Counter, list[float], list[str]]:
    counts: collections.Counter = collections.Counter()
    rss: list[float] = []
    notes: list[str] = []
    start = time.monotonic()
    deadline = start + duration_s

    async def client_loop(k: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            i = k
            while time.monotonic() < deadline:
                j = i % len(bodies)
                outcome, text = await _one(client, bodies[j])
                if outcome == "ok" and text != expected[j]:
                    outcome = "mismatch"
                    notes.append(f"adapter {j}: {text!r} != {expected[j]!r}")
                counts[outcome] += 1
                if outcome.startswith("rejected"):
                    await asyncio.sleep(0.2)  # as a client honouring Retry-After would, if less patiently
                i += 1

    async def events() -> None:
        await asyncio.sleep(duration_s / 4)
        rss.append(await asyncio.to_thread(_ingress_rss_mb))
        if kill:
            await asyncio.sleep(duration_s / 4)
            notes.append(f"killed {await asyncio.to_thread(_kill_one_model_server)} at "
                         f"{time.monotonic() - start:.0f} s")

    await asyncio.gather(events(), *(client_loop(k) for k in range(streams)))
    rss.append(await asyncio.to_thread(_ingress_rss_mb))
    return counts, rss, notes


def _running_model_servers() -> int:
    from ray import serve

    app = serve.status().applications["bench"]
    replicas = app.deployments["LoRAModelServer"].replica_states
    return replicas.get("RUNNING", 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 s, 64 streams over 16 adapters")
    parser.add_argument("--duration", type=float, default=None)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--no-kill", action="store_true", help="no replica is killed")
    a = parser.parse_args(argv)
    duration_s = a.duration or (60.0 if a.quick else 300.0)

    from lora_runtime.demo import MODEL_VOCAB_SIZE, demo_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(SHAPE, vocab=MODEL_VOCAB_SIZE)  # the demo tokenizer's ids fit
        checkpoint = write_random_checkpoint(f"{tmp}/base", **shape)
        model_config = synthetic_config(**shape)
        names = [f"tenant{i}" for i in range(a.adapters)]
        sources = {n: str(write_random_adapter(f"{tmp}/{n}", model_config, r=8, alpha=16, seed=200 + i))
                   for i, n in enumerate(names)}
        args = dict(model=str(checkpoint), tokenizer=str(demo_model_dir()), model_name="load-base",
                    num_replicas=REPLICAS, max_batch=16, max_seq_len=64, max_loras_per_batch=8, max_lora_rank=8,
                    max_ongoing_requests=16, max_queued_requests=16, replica_num_cpus=1.0,
                    registry_url=f"{tmp}/registry.json", compilation_cache_dir=f"{tmp}/jit-cache")
        bodies = [{"model": n, "prompt": _prompt(i), "max_tokens": NEW_TOKENS, "temperature": 0.0,
                   "ignore_eos": True} for i, n in enumerate(names)]
        _progress(f"deploying {REPLICAS} model-server replicas")
        with served_app(args) as app:
            for n, source in sources.items():
                app.register(n, source)

            async def alone() -> list[str]:
                async with httpx.AsyncClient(base_url=app.url, timeout=300) as client:
                    out = []
                    for body in bodies:
                        outcome, text = await _one(client, body)
                        assert outcome == "ok", (outcome, text)
                        out.append(text)
                    return out

            expected = asyncio.run(alone())
            _progress(f"{len(expected)} answers taken alone; loading for {duration_s:.0f} s")
            started = time.monotonic()
            counts, rss, notes = asyncio.run(_load(app.url, bodies, expected, a.streams, duration_s,
                                                   kill=not a.no_kill))
            load_s = time.monotonic() - started
            deadline = time.monotonic() + _RECOVERY_S
            while _running_model_servers() < REPLICAS:
                assert time.monotonic() < deadline, "the killed replica was not replaced"
                time.sleep(1.0)
            recovered_s = time.monotonic() - started - load_s
            again = asyncio.run(alone())
            recovered = again == expected
    for note in notes[:10]:
        _progress(note)
    requests = sum(counts.values())
    rejected = sum(v for k, v in counts.items() if k.startswith("rejected"))
    why = sorted(k for k in counts if k.startswith("rejected:"))
    print_table(["outcome", "requests"], [[k, counts.get(k, 0)] for k in ("ok", "mismatch", *why, "error_5xx", "lost")])
    print_table(["requests/s", "ok tokens/s", "replacement up after load (s)", "answers after", "ingress RSS MB"],
                [[requests / load_s, counts["ok"] * NEW_TOKENS / load_s, recovered_s,
                  "same" if recovered else "DIFFERENT", " -> ".join(f"{v:.0f}" for v in rss)]])
    print(f"requests={requests} errors_5xx={counts['error_5xx']} mismatches={counts['mismatch']} "
          f"rejected={rejected} lost={counts['lost']} rss_growth_mb={rss[-1] - rss[0]:.1f}")


if __name__ == "__main__":
    main()
