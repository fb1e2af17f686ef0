"""One Ray cluster per test session, started the way a user starts it.

`ray start --head --block` runs as our child process, so stopping it stops exactly the
cluster we started (never a global `ray stop`). A GCS emulator runs beside it; the
cluster's processes inherit the environment that points gcsfs at it, through a fault proxy
(tests/fault_proxy.py) that tests switch to play the storage down or hanging.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fault_proxy import FaultProxy
from tests.helpers.xla import child_xla_flags

ADMIN_TOKEN = "integration-admin-token"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    gcs_address: str
    dashboard_url: str
    http_port: int
    env: dict[str, str]
    gcs_emulator: str  # the emulator itself, for tests to put files in
    temp_dir: str
    storage: FaultProxy  # what the cluster's processes reach the emulator through

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def cli(self, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
        """Runs a Ray CLI command against this cluster; raises with its output on failure."""
        proc = subprocess.run(
            list(args), env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def serve_status(self) -> dict:
        """What `serve status` prints, as a dict (application -> status, message, and each
        deployment's status and replica_states), read from the dashboard's REST API: a
        `serve status` process costs about 2 s of CPU, and polling with it took a core's worth
        of the test machine's two while replicas were starting."""
        r = httpx.get(f"{self.dashboard_url}/api/serve/applications/", timeout=60,
                      headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        r.raise_for_status()
        apps = r.json().get("applications") or {}
        return {"applications": {
            name: {"status": app.get("status"), "message": app.get("message", ""),
                   "deployments": {d: {"status": dep.get("status"),
                                       "replica_states": dict(Counter(rep["state"] for rep in dep.get("replicas", [])))}
                                   for d, dep in (app.get("deployments") or {}).items()}}
            for name, app in apps.items()}}

    def wait_running(self, *apps: str, timeout: float = 300.0) -> None:
        """Waits until every Serve application in ``apps`` is RUNNING; a failed deploy raises."""
        deadline = time.monotonic() + timeout
        statuses: dict = {}
        while time.monotonic() < deadline:
            found = self.serve_status()["applications"]
            statuses = {app: found.get(app, {}).get("status") for app in apps}
            if all(s == "RUNNING" for s in statuses.values()):
                return
            if "DEPLOY_FAILED" in statuses.values():
                raise AssertionError(f"deploy failed:\n{yaml.safe_dump(found)}")
            time.sleep(1.0)
        raise TimeoutError(f"applications not RUNNING after {timeout}s (last statuses {statuses})")


def kill_actor(cluster: Cluster, name: str, namespace: str, *, no_restart: bool) -> None:
    """ray.kill on a named actor, from a short-lived driver with the cluster's auth env.

    A separate process, because Ray reads its auth mode when first imported and this
    test process may have imported Ray before the cluster existed.
    """
    code = (
        "import ray, sys\n"
        f"ray.init(address={cluster.gcs_address!r}, namespace={namespace!r}, log_to_driver=False)\n"
        f"ray.kill(ray.get_actor({name!r}), no_restart={no_restart!r})\n"
    )
    cluster.cli(sys.executable, "-c", code)


def ingress_admitted(url: str) -> dict[str, float]:
    """Inference requests each ingress replica admitted, as /metrics under ``url`` shows them."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {i: float(n) for i, n in re.findall(r'^multilora_ingress_requests_total\{ingress="([^"]+)"\} (\S+)', text,
                                               re.M)}


class ReplicaKiller:
    """Kills the replicas of `deployment` (the model server by default) of Serve application
    `app` (ray.kill, no restart: Serve replaces them) the moment `kill()` is called: a driver
    process connected ahead of time, with the replicas' handles resolved, so the kill lands when
    the test says, not after a listing of every actor (a stream can end meanwhile). Every replica
    alive then goes (those started since are listed and killed next), the one serving and any an
    earlier redeploy left draining (killing only the first by name could hit an idle one)."""

    def __init__(self, cluster: Cluster, app: str, deployment: str = "LoRAModelServer"):
        code = (
            "import ray, sys\n"
            f"ray.init(address={cluster.gcs_address!r}, log_to_driver=False)\n"
            "def replicas():\n"
            "    return sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)\n"
            f"                  if a['namespace'] == 'serve' and '::{app}#{deployment}#' in a['name'])\n"
            "def kill(names):\n"
            "    for name in names:\n"
            "        try:\n"
            "            ray.kill(handles.get(name) or ray.get_actor(name, namespace='serve'), no_restart=True)\n"
            "        except ValueError:  # it stopped meanwhile\n"
            "            pass\n"
            "first = replicas()\n"
            "assert first, 'no replica to kill'\n"
            "handles = {}\n"
            "for name in first:\n"
            "    try:\n"
            "        handles[name] = ray.get_actor(name, namespace='serve')\n"
            "    except ValueError:  # it stopped meanwhile\n"
            "        pass\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "kill(first)  # resolved ahead: the kill lands at once\n"
            "later = [name for name in replicas() if name not in handles]  # started since\n"
            "kill(later)\n"
            "print(','.join(first + later), flush=True)\n"
        )
        self._proc = subprocess.Popen([sys.executable, "-c", code], env=cluster.env, cwd=REPO, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self._proc.stdout.readline().strip()
        if line != "ready":
            self._proc.kill()
            raise AssertionError(f"the replica killer did not start: {line!r} {self._proc.stderr.read()}")

    def kill(self) -> str:
        """Kills the replicas now; returns their actor names, comma-separated."""
        out, err = self._proc.communicate("kill\n", timeout=120)
        if self._proc.returncode != 0:
            raise AssertionError(f"the replica killer failed: {err}")
        return out.strip().splitlines()[-1]


def _start_gcs_emulator(port: int):
    from gcp_storage_emulator.server import create_server

    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="adapters")
    thread = threading.Thread(target=server.start, daemon=True)
    thread.start()
    return server


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@pytest.fixture(scope="session")
def cluster():
    emulator_port = free_port()
    emulator = _start_gcs_emulator(emulator_port)
    storage = FaultProxy("127.0.0.1", emulator_port)
    # Ray's socket paths must stay short: a temp dir directly under /tmp.
    temp_dir = tempfile.mkdtemp(prefix="rayit-", dir="/tmp")
    gcs_port, dash_port, client_port, agent_port = (free_port() for _ in range(4))
    env = dict(os.environ)
    env.update(
        # Token auth as Ray 2.60 defaults to, with a token of this cluster's own so the
        # user's ~/.ray/auth_token is neither needed nor touched.
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        LORA_ADMIN_TOKEN=ADMIN_TOKEN,
        STORAGE_EMULATOR_HOST=storage.endpoint,
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        FSSPEC_GS_TOKEN="anon",
        JAX_PLATFORMS="cpu",
        RAY_USAGE_STATS_ENABLED="0",
    )
    # Replicas use their real device count, not the test's fake 4; the session's compile flags stay.
    env["XLA_FLAGS"] = child_xla_flags()
    log = open(os.path.join(temp_dir, "ray-start.log"), "w")
    head = subprocess.Popen(
        [
            "ray", "start", "--head", "--block",
            "--temp-dir", temp_dir,
            "--port", str(gcs_port),
            "--num-cpus", "4",
            "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dash_port),
            "--dashboard-agent-listen-port", str(agent_port),
            "--ray-client-server-port", str(client_port),
            "--disable-usage-stats",
        ],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    c = Cluster(
        gcs_address=f"127.0.0.1:{gcs_port}",
        dashboard_url=f"http://127.0.0.1:{dash_port}",
        http_port=free_port(),
        env=env,
        gcs_emulator=f"http://127.0.0.1:{emulator_port}",
        temp_dir=temp_dir,
        storage=storage,
    )
    try:
        _wait_http(f"{c.dashboard_url}/api/version", timeout=120)
        yield c
    finally:
        # `ray start --block` and the processes it started share a process group of their
        # own (start_new_session): stopping the group stops exactly this cluster. On SIGTERM
        # `ray start --block` takes about 33 s to stop its processes one by one; nothing of
        # the session's cluster needs keeping, so after a moment it is killed.
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever did not stop on SIGTERM
        except ProcessLookupError:
            pass
        head.wait()
        log.close()
        storage.close()
        emulator.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On failure, attach the tail of the Serve replica and actor error logs to the report."""
    outcome = yield
    report = outcome.get_result()
    c = item.funcargs.get("cluster") or item.funcargs.get("app")
    if report.when != "call" or not report.failed or not isinstance(c, Cluster):
        return
    logs = Path(c.temp_dir) / "session_latest" / "logs"
    for f in sorted(logs.glob("serve/replica_*.log")) + sorted(logs.glob("worker-*.err")):
        tail = f.read_text(errors="replace")[-3000:]
        if "Error" in tail:
            report.sections.append((f"log {f.name}", tail))
