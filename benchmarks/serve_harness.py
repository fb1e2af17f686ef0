"""The application served for real, for benchmarks: a local Ray cluster running the Serve
app (`deployments.app:build_app`) on loopback, adapters registered through its admin API,
and an OpenAI-API client (streamed or not)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator, Mapping, Sequence

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served_app(args: dict, *, num_cpus: int = 4, env: dict[str, str] | None = None) -> Iterator["ServedApp"]:
    """Deploys the app with `args` (AppArgs fields) on a fresh local Ray cluster; yields it
    once every replica is running, and stops the cluster after. `env`: environment variables
    of every process of the cluster (Ray Serve's own settings, such as
    RAY_SERVE_THROUGHPUT_OPTIMIZED, which its controller, proxy and replicas read at start)."""
    with served_apps({"": args}, num_cpus=num_cpus, env=env) as apps:
        yield apps[""]


@contextlib.contextmanager
def served_apps(apps: Mapping[str, dict], *, num_cpus: int = 4,
                env: dict[str, str] | None = None) -> Iterator[dict[str, "ServedApp"]]:
    """served_app for several apps on one local Ray cluster, each under its name's route
    prefix (``/<name>``; the name "" serves at ``/``) and Serve application name, behind one
    HTTP proxy; yields {name: ServedApp} once every replica of every app is running. Apps of
    one cluster need their own `admin_actor_name` and `registry_url`."""
    admins = [args.get("admin_actor_name") for args in apps.values()]
    if len(apps) > 1 and len(set(admins)) < len(admins):
        raise ValueError(f"apps on one cluster need distinct admin_actor_name values, got {admins}")
    import ray
    from ray import serve

    from deployments.app import build_app

    token = secrets.token_hex(16)
    env_names = {args.get("admin_token_env", "LORA_ADMIN_TOKEN") for args in apps.values()}
    # address="local": a cluster of its own, never one `ray start` left running on this host.
    # Its processes inherit this one's environment as ray.init finds it.
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {**dict.fromkeys(env_names, token), "JAX_PLATFORMS": "cpu"}})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        served = {}
        for name, args in apps.items():
            serve.run(build_app(args), name=name or "bench", route_prefix=f"/{name}")
            served[name] = ServedApp(f"http://127.0.0.1:{port}" + (f"/{name}" if name else ""), token)
        yield served
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


class ServedApp:
    """A running deployment: its URL and admin token."""

    def __init__(self, url: str, admin_token: str):
        self.url = url
        self.admin_token = admin_token

    def register(self, name: str, source: str) -> None:
        r = httpx.post(f"{self.url}/v1/adapters", json={"name": name, "source": source, "replace": True},
                       headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=300)
        r.raise_for_status()

    def engine_stats(self) -> dict:
        """The model-server replica's engine counters, as /health reports them."""
        r = httpx.get(f"{self.url}/health", timeout=60)
        r.raise_for_status()
        return r.json()["engine"]

    def send_completions(self, requests: Sequence[dict], timeout_s: float = 600.0,
                         stream: bool = True) -> tuple[float, int]:
        """Sends the completion requests at once, each streamed (or, `stream` False, each
        answered whole); returns (seconds from the first send to the last finish, completion
        tokens over all of them)."""
        return asyncio.run(self._send_all(requests, timeout_s, self._stream_one if stream else self._complete_one))

    async def _send_all(self, requests: Sequence[dict], timeout_s: float, send) -> tuple[float, int]:
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout_s) as client:
            start = time.perf_counter()
            tokens = await asyncio.gather(*(send(client, body) for body in requests))
            return time.perf_counter() - start, sum(tokens)

    @staticmethod
    async def _complete_one(client: httpx.AsyncClient, body: dict) -> int:
        r = await client.post("/v1/completions", json=dict(body, stream=False))
        if r.status_code != 200:
            raise RuntimeError(f"completion failed with {r.status_code}: {r.text[:500]!r}")
        return int(r.json()["usage"]["completion_tokens"])

    @staticmethod
    async def _stream_one(client: httpx.AsyncClient, body: dict) -> int:
        body = dict(body, stream=True, stream_options={"include_usage": True})
        usage = None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"completion failed with {r.status_code}: {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    usage = chunk["usage"]
        if usage is None:
            raise RuntimeError("the stream ended without a usage chunk")
        return int(usage["completion_tokens"])
