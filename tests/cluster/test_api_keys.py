"""Keys files, key scopes, the constant-time lookup, rate limits and the ingress's gate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.access import AccessControl, Caller
from cluster.api_keys import KeyRing, digest, main
from cluster.auth import AdminAuth, AuthError
from cluster.ingress_ledger import IngressLedger
from cluster.rate_limit import RateLimited, RateLimiter

ACME, GLOBEX, OPS = "mlk-acme-secret", "mlk-globex-secret", "mlk-ops-secret"


def _keys(*entries: dict) -> str:
    return json.dumps({"keys": list(entries)})


KEYS = _keys(
    {"name": "acme", "sha256": digest(ACME), "adapters": ["acme-*", "shared"], "base_model": True,
     "requests_per_minute": 3, "tokens_per_minute": 100},
    {"name": "globex", "sha256": digest(GLOBEX), "adapters": ["globex-sql"]},
    {"name": "acme-ops", "sha256": digest(OPS), "role": "admin", "adapters": ["acme-*"]},
)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ring() -> KeyRing:
    return KeyRing.from_json(KEYS, "keys.json")


def test_scopes_match_names_and_prefixes():
    acme, globex, ops = _ring().keys
    assert acme.may_use("acme-legal", is_base=False) and acme.may_use("shared", is_base=False)
    assert not acme.may_use("shared-2", is_base=False)  # an exact name is not a prefix
    assert not acme.may_use("globex-sql", is_base=False)
    assert acme.may_use("any-name", is_base=True)
    assert globex.may_use("globex-sql", is_base=False) and not globex.may_use("base", is_base=True)
    # An admin key manages its adapters and generates with none.
    assert ops.covers("acme-legal") and not ops.covers("globex-sql")
    assert not ops.may_use("acme-legal", is_base=False)
    every = KeyRing.from_json(_keys({"name": "all", "sha256": digest("x"), "adapters": ["*"]}), "k").keys[0]
    assert every.may_use("anything", is_base=False)


def test_identify_finds_the_key_by_its_hash_only():
    ring = _ring()
    assert ring.identify(ACME).name == "acme"
    assert ring.identify(OPS).name == "acme-ops"
    assert ring.identify(digest(ACME)) is None  # the stored hash is not itself a key
    assert ring.identify(ACME + " ") is None and ring.identify("") is None


@pytest.mark.parametrize("entry, says", [
    ({"name": "a", "sha256": "ab" * 32, "adapters": "acme-*"}, "adapters must be a list"),
    ({"name": "a", "sha256": "AB" * 32}, "sha256 must be the 64 lower-case hex"),
    ({"name": "a", "sha256": "secret-in-the-clear"}, "a key's secret is never stored"),
    ({"name": "a b", "sha256": "ab" * 32}, "name='a b'"),
    ({"sha256": "ab" * 32}, "name=None"),
    ({"name": "a", "sha256": "ab" * 32, "role": "root"}, "role='root'"),
    ({"name": "a", "sha256": "ab" * 32, "adapters": ["ac*me"]}, "'*' may only end a pattern"),
    ({"name": "a", "sha256": "ab" * 32, "base_model": "yes"}, "base_model='yes'"),
    ({"name": "a", "sha256": "ab" * 32, "requests_per_minute": 0}, "requests_per_minute=0"),
    ({"name": "a", "sha256": "ab" * 32, "tokens_per_minute": 1.5}, "tokens_per_minute=1.5"),
    ({"name": "a", "sha256": "ab" * 32, "role": "admin", "base_model": True}, "an admin key cannot generate"),
    ({"name": "a", "sha256": "ab" * 32, "role": "admin", "requests_per_minute": 5}, "inference keys only"),
    ({"name": "a", "sha256": "ab" * 32, "scopes": []}, "unknown fields ['scopes']"),
    ({"name": "a", "sha256": "ab" * 32, "priority": 1.5}, "priority=1.5 must be an integer"),
    ({"name": "a", "sha256": "ab" * 32, "priority": True}, "priority=True must be an integer"),
    ({"name": "a", "sha256": "ab" * 32, "role": "admin", "priority": 3}, "priority applies to inference keys only"),
])
def test_a_bad_key_entry_names_the_key_and_field(entry, says):
    with pytest.raises(ValueError, match="keys file 'k.json'") as e:
        KeyRing.from_json(_keys(entry), "k.json")
    assert says in str(e.value)


@pytest.mark.parametrize("text, says", [
    ("{not json", "not valid JSON"),
    ('{"keys": {}}', "one field, 'keys', a list"),
    ('{"keys": [], "extra": 1}', "one field, 'keys', a list"),
    ('{"keys": [3]}', "key 0: must be an object"),
    (_keys({"name": "a", "sha256": "ab" * 32}, {"name": "a", "sha256": "cd" * 32}), "the same name 'a'"),
    (_keys({"name": "a", "sha256": "ab" * 32}, {"name": "b", "sha256": "ab" * 32}), "the same sha256 of key 'b'"),
])
def test_a_bad_keys_file_says_why(text, says):
    with pytest.raises(ValueError, match="k.json") as e:
        KeyRing.from_json(text, "k.json")
    assert says in str(e.value)


def test_new_prints_a_key_whose_entry_the_file_accepts(capsys):
    assert main(["new", "--name", "t1", "--adapter", "t1-*", "--base-model", "--requests-per-minute", "60"]) == 0
    out = capsys.readouterr()
    secret = out.err.split(": ")[-1].strip()
    entry = json.loads(out.out)
    assert secret not in out.out  # stdout (the file's entry) holds the hash only
    ring = KeyRing.from_json(_keys(entry), "k")
    assert ring.identify(secret).name == "t1" and ring.keys[0].requests_per_minute == 60
    assert main(["new", "--name", "bad name"]) == 2


def test_hash_and_check_from_the_command_line(tmp_path):
    run = [sys.executable, "-m", "cluster.api_keys"]
    got = subprocess.run(run + ["hash"], input=ACME + "\n", capture_output=True, text=True, check=True)
    assert got.stdout.strip() == digest(ACME)
    path = tmp_path / "keys.json"
    path.write_text(KEYS)
    listed = subprocess.run(run + ["check", str(path)], capture_output=True, text=True, check=True).stdout
    assert "acme: inference, adapters: acme-*, shared" in listed and ACME not in listed
    path.write_text(_keys({"name": "a", "sha256": "nope"}))
    bad = subprocess.run(run + ["check", str(path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "key 'a'" in bad.stderr


def test_request_rate_bursts_to_its_limit_then_refills():
    clock = Clock()
    limiter = RateLimiter(clock)
    acme = _ring().keys[0]  # 3 requests a minute
    for _ in range(3):
        limiter.admit(acme)
    with pytest.raises(RateLimited, match="3 requests per minute") as e:
        limiter.admit(acme)
    assert e.value.retry_after_s == 20  # one request refills in 60 / 3 s
    clock.t += 19.0
    with pytest.raises(RateLimited) as e:
        limiter.admit(acme)
    assert e.value.retry_after_s == 1
    clock.t += 1.0
    limiter.admit(acme)


def test_tokens_are_charged_after_and_a_debt_blocks_until_repaid():
    clock = Clock()
    limiter = RateLimiter(clock)
    acme = _ring().keys[0]  # 100 tokens a minute
    limiter.admit(acme)
    limiter.charge(acme, 130)  # one response may overshoot
    with pytest.raises(RateLimited, match="100 tokens per minute") as e:
        limiter.admit(acme)
    assert e.value.retry_after_s == 18  # a debt of 30 tokens at 100/60 a second
    clock.t += 18.0
    limiter.admit(acme)
    # A key with no limits is never refused, and keeps no buckets.
    globex = _ring().keys[1]
    for _ in range(1000):
        limiter.admit(globex)
        limiter.charge(globex, 10_000)


def test_a_changed_limit_applies_to_the_existing_bucket():
    clock = Clock()
    limiter = RateLimiter(clock)
    acme = _ring().keys[0]
    for _ in range(3):
        limiter.admit(acme)
    raised = KeyRing.from_json(KEYS.replace('"requests_per_minute": 3', '"requests_per_minute": 600'), "k").keys[0]
    with pytest.raises(RateLimited):  # the spent budget stays spent
        limiter.admit(raised)
    clock.t += 1.0  # from now on 10 requests refill in a second, at 600 a minute
    for _ in range(10):
        limiter.admit(raised)
    with pytest.raises(RateLimited):
        limiter.admit(raised)


def _access(tmp_path, text: str = KEYS, token: str | None = "admin-token") -> AccessControl:
    path = tmp_path / "keys.json"
    path.write_text(text)
    access = AccessControl(AdminAuth("LORA_ADMIN_TOKEN", token), str(path))
    access.install(access.read())
    return access


def _refused(call, *args) -> int:
    with pytest.raises(AuthError) as e:
        call(*args)
    return e.value.status_code


def test_no_keys_file_leaves_inference_open_and_admin_on_the_token():
    access = AccessControl(AdminAuth("LORA_ADMIN_TOKEN", "admin-token"))
    assert not access.enabled
    assert access.inference(None) == Caller() and access.inference("Bearer anything") == Caller()
    assert access.admin("Bearer admin-token") == Caller()
    assert _refused(access.admin, "Bearer nope") == 403 and _refused(access.admin, None) == 401


def test_inference_needs_an_inference_key(tmp_path):
    access = _access(tmp_path)
    assert access.inference(f"Bearer {GLOBEX}").key.name == "globex"
    assert _refused(access.inference, None) == 401
    assert _refused(access.inference, "Bearer wrong") == 401
    assert _refused(access.inference, "Basic abc") == 401
    assert _refused(access.inference, f"Bearer {OPS}") == 403  # an admin key
    assert _refused(access.inference, "Bearer admin-token") == 401  # the admin token generates nothing
    with pytest.raises(AuthError) as e:
        access.inference("Bearer wrong")
    assert "wrong" not in e.value.message  # a key is never echoed


def test_admin_takes_the_token_or_an_admin_key(tmp_path):
    access = _access(tmp_path)
    assert access.admin("Bearer admin-token") == Caller()  # every adapter
    ops = access.admin(f"Bearer {OPS}")
    assert ops.may_admin("acme-x") and not ops.may_admin("globex-sql")
    assert _refused(access.admin, f"Bearer {ACME}") == 403
    assert _refused(access.admin, "Bearer wrong") == 401
    # Without an admin token configured, admin keys still work.
    access = _access(tmp_path, token=None)
    assert access.admin(f"Bearer {OPS}").key.name == "acme-ops"
    assert _refused(access.admin, "Bearer admin-token") == 401


def test_a_reread_file_revokes_and_adds_keys_and_a_bad_one_changes_nothing(tmp_path):
    access = _access(tmp_path)
    ledger = IngressLedger(Clock())
    for _ in range(3):
        assert ledger.admit(access.inference(f"Bearer {ACME}").key) is None
    assert not access.install(access.read())  # unchanged
    new = _keys({"name": "acme", "sha256": digest(ACME), "adapters": ["acme-*"], "requests_per_minute": 3},
                {"name": "initech", "sha256": digest("mlk-initech"), "adapters": ["initech-*"]})
    assert access.install(new)
    ledger.forget(access.key_names())
    assert _refused(access.inference, f"Bearer {GLOBEX}") == 401  # revoked
    assert access.inference("Bearer mlk-initech").key.name == "initech"
    # The kept key keeps its spent budget.
    assert "3 requests per minute" in ledger.admit(access.inference(f"Bearer {ACME}").key)[0]
    with pytest.raises(ValueError, match="not valid JSON"):
        access.install("{broken")
    assert access.inference("Bearer mlk-initech").key.name == "initech"
    assert access.key_names() == ["acme", "initech"]
    (tmp_path / "keys.json").unlink()
    with pytest.raises(OSError):
        access.read()


def test_the_readme_recipe_makes_a_keys_file_the_server_reads(tmp_path):
    """The README's commands, as written, in a fresh folder: three keys in keys.json, each
    printed once, and `check` lists them without their secrets."""
    import os

    from tests.helpers.readme import fenced_block

    script = fenced_block("### Scoped API keys")
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script.replace("python ", f"{sys.executable} ")],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    secrets = [line.split(": ")[-1] for line in done.stderr.splitlines() if line.startswith("key (shown once")]
    access = AccessControl(AdminAuth("T", None), str(tmp_path / "keys.json"))
    access.install(access.read())
    acme, batch = access.inference(f"Bearer {secrets[0]}").key, access.inference(f"Bearer {secrets[1]}").key
    ops = access.admin(f"Bearer {secrets[2]}").key
    assert (acme.name, acme.requests_per_minute, acme.tokens_per_minute, acme.base_model) == ("acme", 600, 200000, True)
    assert (batch.name, batch.priority, acme.priority) == ("acme-batch", 10, 0)
    assert (ops.name, ops.role, ops.adapters) == ("acme-ops", "admin", ("acme-*",))
    assert "acme-ops: admin" in done.stdout and not any(s in done.stdout for s in secrets)
    again = subprocess.run([sys.executable, "-m", "cluster.api_keys", "new", "--keys-file", "keys.json",
                            "--name", "acme"], cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 2 and "the same name 'acme'" in again.stderr
    assert len(access.read()) == len((tmp_path / "keys.json").read_text())  # unchanged by the refusal


def test_a_keys_priority_is_the_most_urgent_its_requests_run_at(capsys):
    from deployments.ingress import request_priority

    assert main(["new", "--name", "batch", "--adapter", "b-*", "--priority", "10"]) == 0
    entry = json.loads(capsys.readouterr().out)
    ring = KeyRing.from_json(_keys(entry, {"name": "acme", "sha256": digest(ACME)}), "k")
    batch, plain = Caller(ring.keys[0]), Caller(ring.identify(ACME))
    assert ring.keys[0].priority == 10 and ring.identify(ACME).priority == 0
    # Under scheduling_policy priority: a request may be less urgent than its key, never more.
    assert [request_priority("priority", batch, p) for p in (-5, 0, 10, 20)] == [10, 10, 10, 20]
    assert [request_priority("priority", plain, p) for p in (-5, 0, 3)] == [0, 0, 3]
    assert request_priority("priority", Caller(None), -5) == -5  # the admin token, or keys off
    # Under fcfs the key changes nothing: the replica takes priority 0 only and refuses the rest.
    assert [request_priority("fcfs", batch, p) for p in (0, 4)] == [0, 4]
