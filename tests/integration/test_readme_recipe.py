"""The README's serving recipe, run as written: its commands read from README.md and run in
bash with a fresh HOME, then a completion from the `reverse` adapter on port 8000.

The recipe starts a Ray cluster of its own on Ray's default ports. This test gives it a
temp root of its own (RAY_TMPDIR) and stops exactly the processes that carry it, never
`ray stop`, which would stop every Ray cluster on the machine (the other integration
tests' session cluster included).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.readme import fenced_block
from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration

HEADING = "## Serving over HTTP (Ray Serve)"
# The ports the recipe's cluster takes: serve_config.yaml's HTTP port and Ray's defaults.
PORTS = {8000: "the app's HTTP port", 6379: "Ray's GCS", 8265: "Ray's dashboard", 10001: "Ray's client server"}
REQUEST = {"model": "reverse", "prompt": "hello=", "max_tokens": 16, "temperature": 0}
_START_TIMEOUT_S = 300.0
_TERM_GRACE_S = 5.0  # raylet and gcs_server may ignore SIGTERM for longer; the rest is SIGKILL


def _busy_ports() -> list[str]:
    busy = []
    for port, what in PORTS.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError:
                busy.append(f"{port} ({what})")
    return busy


def _cluster_pids(group: int, ray_tmp: str) -> list[int]:
    """Live processes of the recipe's cluster: those in the recipe shell's process group
    (what `ray start` started) and those whose environment carries its RAY_TMPDIR (Ray's
    workers, which the raylet starts in process groups of their own)."""
    marker = f"RAY_TMPDIR={ray_tmp}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            state, _ppid, pgid = stat[stat.rindex(")") + 2:].split()[:3]
            if state == "Z":
                continue
            if int(pgid) == group or marker in Path(entry.path, "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or another user's
            continue
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(env: dict[str, str], group: int, ray_tmp: str) -> list[int]:
    """`serve shutdown`, then SIGTERM and, after a grace period, SIGKILL to every process of
    the recipe's cluster; returns the processes still alive after that (none, we hope)."""
    subprocess.run(["serve", "shutdown", "-y"], env={**env, "RAY_AUTH_MODE": "token"}, cwd=REPO,
                   capture_output=True, timeout=120)
    for sig, wait_s in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, 10.0)):
        _signal_all(_cluster_pids(group, ray_tmp), sig)
        deadline = time.monotonic() + wait_s
        while _cluster_pids(group, ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
    return _cluster_pids(group, ray_tmp)


def _complete(log: Path) -> dict:
    """The README's completion request, retried until the app answers it."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.post("http://127.0.0.1:8000/v1/completions", json=REQUEST, timeout=60)
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code}: {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1.0)
    raise AssertionError(f"no completion within {_START_TIMEOUT_S}s (last: {last}); recipe output:\n"
                         f"{log.read_text()[-3000:]}")


def test_readme_serving_recipe_as_written(tmp_path):
    recipe = fenced_block(HEADING)
    assert "ray start" in recipe and "serve deploy" in recipe, recipe
    busy = _busy_ports()
    assert not busy, (
        f"the README recipe starts Ray on its default ports and these are taken: {', '.join(busy)}; "
        "stop what holds them (another Ray cluster? `ray status`) and rerun"
    )
    home = tempfile.mkdtemp(prefix="home-")  # as HOME=$(mktemp -d): no Ray token, no registry
    ray_tmp = tempfile.mkdtemp(prefix="rayrc-", dir="/tmp")  # short: Ray's socket paths live here
    # The user's environment, less the test session's Ray settings and fake devices.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "XLA_FLAGS"}
    env.update(HOME=home, RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    log = tmp_path / "recipe.log"
    with open(log, "w") as out:
        shell = subprocess.Popen(["bash", "-e", "-c", recipe], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    left: list[int] = []
    try:
        rc = shell.wait(timeout=_START_TIMEOUT_S)
        assert rc == 0, f"the recipe failed ({rc}):\n{log.read_text()[-3000:]}"
        assert (Path(home) / ".ray" / "auth_token").is_file()
        body = _complete(log)
        assert body["choices"][0]["text"] == "olleh", body
        # Safe: Ray's own services refuse a caller without the token.
        assert httpx.get("http://127.0.0.1:8265/api/version", timeout=10).status_code == 401
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
        left = _stop(env, shell.pid, ray_tmp)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"processes of the recipe's cluster still running: {left}"
    assert not _busy_ports(), "the recipe's cluster still holds its ports after stopping"
