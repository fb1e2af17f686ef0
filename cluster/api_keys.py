"""Scoped API keys: which adapters a key may call, or administer, and at what rate.

A keys file (JSON, at a local path or an fsspec URL) lists keys by the SHA-256 of their
secret; the secrets themselves are never stored or logged::

    {"keys": [
      {"name": "acme", "sha256": "<64 hex>", "adapters": ["acme-*", "shared-sql"],
       "base_model": true, "requests_per_minute": 600, "tokens_per_minute": 200000},
      {"name": "acme-batch", "sha256": "<64 hex>", "adapters": ["acme-*"], "priority": 10},
      {"name": "acme-ops", "sha256": "<64 hex>", "role": "admin", "adapters": ["acme-*"]}
    ]}

``adapters`` holds adapter names and name prefixes (ending in ``*``; ``"*"`` alone is every
adapter). An ``inference`` key (the default role) may call the adapters its patterns match,
and the base model when ``base_model`` is true; an ``admin`` key may register, list, pin and
unregister adapters whose names its patterns match, and cannot generate. An inference key's
``priority`` (default 0) is the most urgent priority its requests run at where the
deployment's scheduling_policy is ``priority``: a request's own ``priority`` may make it less
urgent (a larger value), never more (a batch tier cannot jump ahead). ``python -m
cluster.api_keys new --name acme --adapter 'acme-*' --keys-file keys.json`` makes a key,
prints it once and adds its entry to the file.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import re
import secrets
import sys
from dataclasses import dataclass

ROLES = ("inference", "admin")
_KEY_PREFIX = "mlk-"
_FIELDS = {"name", "sha256", "role", "adapters", "base_model", "requests_per_minute", "tokens_per_minute",
           "priority"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class KeysFileError(ValueError):
    """A keys file, or a key entry, that is not valid; the message names the key and field."""


def digest(secret: str) -> str:
    """The hex SHA-256 of a key's secret: what a keys file stores. API keys are long random
    strings, so a fast hash is enough (there is no password to guess)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return _KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ApiKey:
    """One key's entry (its name, never its secret, goes in logs and errors)."""

    name: str
    sha256: str
    role: str = "inference"
    adapters: tuple[str, ...] = ()
    base_model: bool = False
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    priority: int = 0

    def covers(self, adapter: str) -> bool:
        """Whether one of this key's patterns matches the adapter name."""
        return any(adapter.startswith(p[:-1]) if p.endswith("*") else adapter == p for p in self.adapters)

    def may_use(self, model: str, *, is_base: bool) -> bool:
        """Whether this (inference) key may generate with the model: the base or an adapter."""
        return self.role == "inference" and (self.base_model if is_base else self.covers(model))

    def scope(self) -> str:
        return ", ".join(self.adapters) or "no adapters"


def _entry(i: int, raw, url: str) -> ApiKey:
    where = f"keys file {url!r}, key {i}"
    if not isinstance(raw, dict):
        raise KeysFileError(f"{where}: must be an object, not {type(raw).__name__}")
    name = raw.get("name")
    if isinstance(name, str):
        where = f"keys file {url!r}, key {name!r}"
    if unknown := sorted(set(raw) - _FIELDS):
        raise KeysFileError(f"{where}: unknown fields {unknown} (known: {sorted(_FIELDS)})")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise KeysFileError(f"{where}: name={name!r} must be 1-128 letters, digits, '.', '_' or '-'")
    sha = raw.get("sha256")
    if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
        raise KeysFileError(f"{where}: sha256 must be the 64 lower-case hex digits of the key's SHA-256 "
                            "(python -m cluster.api_keys hash); a key's secret is never stored")
    role = raw.get("role", "inference")
    if role not in ROLES:
        raise KeysFileError(f"{where}: role={role!r} must be one of {list(ROLES)}")
    adapters = raw.get("adapters", [])
    if not isinstance(adapters, list) or not all(isinstance(p, str) and p.strip() for p in adapters):
        raise KeysFileError(f"{where}: adapters must be a list of adapter names or name prefixes ending in '*'")
    if bad := [p for p in adapters if "*" in p[:-1]]:
        raise KeysFileError(f"{where}: adapters {bad}: '*' may only end a pattern (a name prefix)")
    base_model = raw.get("base_model", False)
    if not isinstance(base_model, bool):
        raise KeysFileError(f"{where}: base_model={base_model!r} must be true or false")
    if role == "admin" and base_model:
        raise KeysFileError(f"{where}: an admin key cannot generate, so base_model must be false")
    limits = {}
    for field in ("requests_per_minute", "tokens_per_minute"):
        v = raw.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise KeysFileError(f"{where}: {field}={v!r} must be a positive integer or null (no limit)")
        if v is not None and role == "admin":
            raise KeysFileError(f"{where}: {field} applies to inference keys only")
        limits[field] = v
    priority = raw.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise KeysFileError(f"{where}: priority={priority!r} must be an integer (lower is more urgent)")
    if priority != 0 and role == "admin":
        raise KeysFileError(f"{where}: priority applies to inference keys only")
    return ApiKey(name=name, sha256=sha, role=role, adapters=tuple(adapters), base_model=base_model,
                  priority=priority, **limits)


@dataclass(frozen=True)
class KeyRing:
    """The keys of one keys file."""

    keys: tuple[ApiKey, ...]

    @classmethod
    def from_json(cls, text: str, url: str) -> "KeyRing":
        """Parses a keys file; any fault is a KeysFileError naming the file, the key and the field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise KeysFileError(f"keys file {url!r} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or set(data) != {"keys"} or not isinstance(data["keys"], list):
            raise KeysFileError(f"keys file {url!r} must be an object with one field, 'keys', a list of keys")
        keys = tuple(_entry(i, raw, url) for i, raw in enumerate(data["keys"]))
        for field in ("name", "sha256"):
            seen: set[str] = set()
            for k in keys:
                value = getattr(k, field)
                if value in seen:
                    shown = repr(value) if field == "name" else f"of key {k.name!r}"
                    raise KeysFileError(f"keys file {url!r}: two keys have the same {field} {shown}")
                seen.add(value)
        return cls(keys)

    def identify(self, secret: str) -> ApiKey | None:
        """The key whose hash the secret's is, compared in constant time against every key (no
        early exit, so the time taken says nothing of which or how many bytes matched)."""
        given = digest(secret).encode()
        found = None
        for key in self.keys:
            if hmac.compare_digest(given, key.sha256.encode()):
                found = key
        return found


def _new(args) -> int:
    secret = new_secret()
    entry: dict = {"name": args.name, "sha256": digest(secret), "role": args.role, "adapters": args.adapter}
    if args.role == "inference":
        entry["base_model"] = args.base_model
        entry["requests_per_minute"] = args.requests_per_minute
        entry["tokens_per_minute"] = args.tokens_per_minute
        entry["priority"] = args.priority
    _entry(0, entry, "<new>")  # the same checks a keys file gets
    if args.keys_file:
        _append(args.keys_file, entry)
    print(f"key (shown once, give it to the client): {secret}", file=sys.stderr)
    print(json.dumps(entry))
    return 0


def _append(path: str, entry: dict) -> None:
    """Adds an entry to a local keys file (made if absent), checking the whole file first."""
    try:
        with open(path) as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        doc = {"keys": []}
    except json.JSONDecodeError as e:
        raise KeysFileError(f"keys file {path!r} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise KeysFileError(f"keys file {path!r} must be an object with one field, 'keys', a list of keys")
    doc["keys"].append(entry)
    text = json.dumps(doc, indent=1)
    KeyRing.from_json(text, path)  # e.g. a name already there
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _hash(args) -> int:
    secret = sys.stdin.readline().strip()
    if not secret:
        print("no key on standard input", file=sys.stderr)
        return 2
    print(digest(secret))
    return 0


def _check(args) -> int:
    with open(args.path) as f:
        ring = KeyRing.from_json(f.read(), args.path)
    for k in ring.keys:
        print(f"{k.name}: {k.role}, adapters: {k.scope()}, base model: {k.base_model}, "
              f"rpm: {k.requests_per_minute}, tpm: {k.tokens_per_minute}, priority: {k.priority}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.api_keys", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="make a key: the secret goes to stderr, its keys-file entry to stdout")
    new.add_argument("--name", required=True)
    new.add_argument("--role", choices=ROLES, default="inference")
    new.add_argument("--adapter", action="append", default=[], help="adapter name or prefix* (repeatable)")
    new.add_argument("--base-model", action="store_true", help="the key may use the base model")
    new.add_argument("--requests-per-minute", type=int)
    new.add_argument("--tokens-per-minute", type=int)
    new.add_argument("--priority", type=int, default=0,
                     help="the most urgent priority the key's requests run at (scheduling_policy priority)")
    new.add_argument("--keys-file", help="also add the entry to this local keys file (made if absent)")
    new.set_defaults(run=_new)
    sub.add_parser("hash", help="the sha256 entry of a key read from standard input").set_defaults(run=_hash)
    check = sub.add_parser("check", help="parse a keys file and list its keys (never secrets)")
    check.add_argument("path")
    check.set_defaults(run=_check)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeysFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
