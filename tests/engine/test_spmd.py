"""A replica over two processes (engine/spmd.py), without Ray: two real processes of 2 host
devices each join one JAX runtime (CPU collectives), the leader serves and the follower
follows; their outputs equal one process's with the same 4-way tensor parallelism."""

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from lora_runtime.engine import spmd
from lora_runtime.engine.engine import Engine
from lora_runtime.errors import HostLostError
from tests.helpers.checkpoints import save_tiny_llama
from tests.helpers.spmd_host import engine_config, run_requests
from tests.helpers.xla import child_xla_flags
from tests.lora.peft_adapters import make_peft_adapter

REPO = Path(__file__).resolve().parents[2]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("spmd_llama"), num_kv_heads=4)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Three adapters for two slots (writes and evictions): plain, DoRA (its terms computed
    across hosts with the write) and one on q/v only."""
    root = tmp_path_factory.mktemp("spmd_adapters")
    return {
        "plain": str(make_peft_adapter(checkpoint, root / "plain", r=8, alpha=16, target_modules=ALL, seed=1)),
        "dora": str(make_peft_adapter(checkpoint, root / "dora", r=4, alpha=8, target_modules=ALL, seed=2,
                                      use_dora=True)),
        "qv": str(make_peft_adapter(checkpoint, root / "qv", r=16, alpha=8, target_modules=["q_proj", "v_proj"],
                                    seed=3)),
    }


def _run_pair(checkpoint, adapters, out: Path, **follower_spec) -> dict:
    """Runs a leader and a follower process to the end; the leader's result."""
    spec = dict(processes=2, local_devices=2, coordinator_port=free_port(), link_port=free_port(),
                authkey=secrets.token_hex(16), checkpoint=str(checkpoint), adapters=adapters, out=str(out))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["XLA_FLAGS"] = child_xla_flags()  # each process adds its own device count
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.spmd_host",
                               json.dumps({**spec, "role": role, "process_id": i,
                                           **(follower_spec if role == "follower" else {})})],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, role in enumerate(("leader", "follower"))]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if not out.exists():
        raise AssertionError("the leader wrote no result:\n" + "\n".join(log[-3000:] for log in logs))
    return json.loads(out.read_text())


def test_two_processes_serve_as_one(checkpoint, adapters, tmp_path):
    got = _run_pair(checkpoint, adapters, tmp_path / "out.json")
    assert got.get("lost") is None, got
    assert got["compiles_after_warmup"] == 0
    assert got["ops_sent"] > 0
    engine = Engine.from_pretrained(str(checkpoint), engine_config(4)).start()
    try:
        want = run_requests(engine, adapters)
    finally:
        engine.shutdown()
    assert len(got["outputs"]) == len(want)
    for g, w in zip(got["outputs"], want):
        assert g["tokens"] == w["tokens"]
        for key in ("logprobs", "prompt_logprobs"):
            if w[key] is None:
                assert g[key] is None
            else:
                np.testing.assert_allclose(np.array(g[key], float), np.array(w[key], float), rtol=1e-4, atol=1e-4)
    # The adapters changed the outputs (so their writes reached both hosts' shards).
    base = [o["tokens"] for o in want[:3]]
    assert all([o["tokens"] for o in want[3 * k:3 * k + 3]] != base for k in (1, 2, 3))


def test_a_lost_host_fails_requests_with_503(checkpoint, adapters, tmp_path):
    got = _run_pair(checkpoint, adapters, tmp_path / "out.json", die_after_samples=3)
    assert "outputs" not in got, got
    assert got["lost"] is not None and "host 1" in got["lost"]
    assert got["status"] == 503, got


def test_mirror_refuses_ops_from_two_threads():
    mirror = spmd.Mirror({})
    inside, release, errors = threading.Event(), threading.Event(), []

    def launch():
        with mirror.issuing("runner", "forward", ()):
            inside.set()
            release.wait(10)

    other = threading.Thread(target=launch)
    other.start()
    assert inside.wait(10)
    try:
        with mirror.issuing("runner", "sample", ()):
            pass
    except RuntimeError as err:
        errors.append(err)
    release.set()
    other.join(10)
    assert errors and "one thread" in str(errors[0])
    with mirror.issuing("runner", "sample", ()):  # once the first is launched, the next goes
        pass


def test_a_lost_mirror_refuses_ops():
    mirror = spmd.Mirror({})
    mirror.lose("host 1 closed its connection")
    with pytest.raises(HostLostError, match="host 1 closed"):
        with mirror.issuing("runner", "forward", ()):
            pass
