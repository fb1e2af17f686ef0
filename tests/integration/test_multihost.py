"""A replica over two hosts through Serve (hosts_per_replica=2): the replica and a worker in its
placement group, each a real process with 2 host devices, join one JAX runtime (CPU
collectives) and serve over HTTP exactly what one process with tensor_parallel_size 4
serves; a host that dies fails the replica, and Serve replaces it whole."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
import pytest
import yaml

from cluster.admin import ADMIN_NAMESPACE
from tests.helpers.checkpoints import save_tiny_llama
from tests.integration.adapters import save_peft_adapter
from tests.integration.conftest import ADMIN_TOKEN, REPO, kill_actor

pytestmark = pytest.mark.integration

ADMIN_ACTOR = "lora_admin_multihost"
APP, PREFIX = "multihost", "/multihost"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HOSTS = dict(num_replicas=1, hosts_per_replica=2, tensor_parallel_size=4, accelerator="cpu", replica_num_cpus=0.5)
PROMPTS = ("the quick brown fox", "hello world", "numbers 0123")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    tiny = save_tiny_llama(root / "tiny", num_kv_heads=4)  # 4 kv heads: 4-way tensor parallel
    return {"root": root, "tiny": tiny, "adapter": save_peft_adapter(tiny, root / "adapter", seed=11)}


@pytest.fixture(scope="module")
def args(files) -> dict:
    [template] = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"]
    # Small shapes and one prefill bucket: every step compiles in both processes, on the same two cores.
    return {**template["args"], "model": str(files["tiny"]), "model_name": "tiny", "max_seq_len": 32, "max_batch": 4,
            "max_prefill_tokens": 16,
            "max_loras_per_batch": 2, "max_lora_rank": 8, "lora_modules_to_save_max_bytes": 0,
            "registry_url": str(files["root"] / "registry.json"), "admin_actor_name": ADMIN_ACTOR,
            "drain_timeout_s": 1.0, **HOSTS}


@pytest.fixture(scope="module")
def app(cluster, files, args):
    [template] = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"]
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": cluster.http_port}
    config["applications"] = [{**template, "name": APP, "route_prefix": PREFIX, "args": args}]
    path = files["root"] / "multihost.yaml"
    path.write_text(yaml.safe_dump(config))
    cluster.cli("serve", "deploy", str(path), "-a", cluster.dashboard_url)
    cluster.wait_running(APP, timeout=600)
    r = httpx.post(f"{cluster.base_url}{PREFIX}/v1/adapters", headers=AUTH, timeout=120,
                   json={"name": "ad", "source": str(files["adapter"])})
    assert r.status_code == 201, r.text
    yield cluster
    cluster.cli("serve", "shutdown", "-y", "-a", cluster.dashboard_url)
    kill_actor(cluster, ADMIN_ACTOR, ADMIN_NAMESPACE, no_restart=True)


def _complete(cluster, model: str, prompt: str, **sampling) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **sampling}
    return httpx.post(f"{cluster.base_url}{PREFIX}/v1/completions", timeout=120, json=body)


def _reference(files, args) -> dict:
    """One process, 4 devices: the text of every (model, prompt, sampling) the tests send."""
    from cluster.admin import sync_entries
    from deployments.config import AppArgs
    from lora_runtime.engine.engine import Engine
    from lora_runtime.engine.sampling import SamplingParams

    engine = Engine.from_pretrained(str(files["tiny"]), AppArgs(**args).engine_config(), model_name="tiny").start()
    try:
        engine.lora_manager.sync(sync_entries({"ad": {"source": str(files["adapter"]), "version": 1,
                                                      "pinned": False}}))
        out = {}
        for model in ("tiny", "ad"):
            for prompt in PROMPTS:
                for seed in (None, 3):
                    params = SamplingParams(max_tokens=8, temperature=0.0 if seed is None else 1.0, seed=seed)
                    [got] = engine.generate_batch([prompt], params, [None if model == "tiny" else model])
                    out[model, prompt, seed] = got.text
        return out
    finally:
        engine.shutdown()


def _workers(cluster) -> list[dict]:
    """The live HostWorker actors (id, pid) of the cluster, from Ray's state API."""
    code = (
        "import json, ray\n"
        "from ray.util.state import list_actors\n"
        f"ray.init(address={cluster.gcs_address!r}, log_to_driver=False)\n"
        "actors = list_actors(filters=[('class_name', '=', 'HostWorker'), ('state', '=', 'ALIVE')], detail=True)\n"
        "print(json.dumps([{'id': a.actor_id, 'pid': a.pid} for a in actors]))\n"
    )
    return json.loads(cluster.cli(sys.executable, "-c", code).stdout.strip().splitlines()[-1])


def test_a_replica_over_two_hosts_serves_what_one_process_serves(app, files, args):
    devices = httpx.get(f"{app.base_url}{PREFIX}/health", timeout=30).json()["engine"]["devices"]
    assert len(devices) == 4 and all(d.startswith("cpu:") for d in devices), devices
    assert len({d.split(":")[1] for d in devices}) == 4  # two processes' devices, one mesh
    assert len(_workers(app)) == 1  # the replica leads one worker, on the other "host"
    want = _reference(files, args)
    assert len(set(want.values())) > len(PROMPTS)  # the adapter changes answers
    for (model, prompt, seed), text in want.items():
        sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
        r = _complete(app, model, prompt, **sampling)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text, (model, prompt, seed)


def test_a_lost_host_fails_the_replica_and_serve_replaces_it_whole(app):
    want = _complete(app, "ad", PROMPTS[0]).json()["choices"][0]["text"]
    [worker] = _workers(app)
    os.kill(worker["pid"], signal.SIGKILL)  # the other host dies
    codes, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            r = _complete(app, "ad", PROMPTS[0])
        except httpx.HTTPError:
            codes.append("no answer")
        else:
            if r.status_code == 200 and codes:
                break
            codes.append(r.status_code)
            if r.status_code != 200:
                # The lost replica's own failure, a 503 to retry: never a 4xx, and never the 500 of
                # the step whose collective lost its peer.
                assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text)
        time.sleep(1.0)
    else:
        raise AssertionError(f"no replacement replica answered within 300 s: {codes[-10:]}")
    assert r.json()["choices"][0]["text"] == want
    [new] = _workers(app)
    assert new["id"] != worker["id"]  # a new replica with a worker of its own
