"""Who may call what: the keys file (cluster/api_keys.py) and the admin token.

With no keys file the inference API is open and the admin API takes the operator's admin
token, as before keys existed. With one, every inference call needs an inference key, which
reaches only the models its scope names (others look as if they did not exist), and admin
calls take the admin token (every adapter) or an admin key (the adapters its scope names).
The keys file is read again every ``refresh_s``: keys are added, changed and revoked without
a redeploy; a file that fails to read or parse leaves the keys in force as they were. A
key's rate limits are applied where the ingress replicas share them (cluster/ingress_ledger.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import fsspec

from cluster.api_keys import ApiKey, KeyRing
from cluster.auth import AdminAuth, AuthError, bearer


@dataclass(frozen=True)
class Caller:
    """Whom a request acts for: an API key, or None (keys off, or the operator's admin token)."""

    key: ApiKey | None = None

    def may_use(self, model: str, *, is_base: bool) -> bool:
        return self.key is None or self.key.may_use(model, is_base=is_base)

    def may_admin(self, adapter: str) -> bool:
        return self.key is None or self.key.covers(adapter)

    def scope(self) -> str:
        return "every adapter" if self.key is None else self.key.scope()

    def priority(self, requested: int) -> int:
        """The priority a request asking for ``requested`` runs at: never more urgent (lower)
        than its key's."""
        return requested if self.key is None else max(requested, self.key.priority)


def _url(url: str) -> str:
    return url if "://" in url else os.path.abspath(os.path.expanduser(url))


class AccessControl:
    """The ingress's gate. Not thread-safe: called on the ingress's event loop, apart from
    ``read`` (file I/O, run in a worker thread) whose result ``install`` takes."""

    def __init__(self, admin: AdminAuth, keys_url: str | None = None):
        self._admin = admin
        self.keys_url = None if keys_url is None else _url(keys_url)
        self._ring: KeyRing | None = None
        self._text: str | None = None

    @property
    def enabled(self) -> bool:
        return self.keys_url is not None

    def read(self) -> str:
        with fsspec.open(self.keys_url, "r", encoding="utf-8") as f:
            return f.read()

    def install(self, text: str) -> bool:
        """Parses the keys file's text and puts it in force; False when it is unchanged. A bad
        file raises KeysFileError (naming the key and field) and changes nothing."""
        if text == self._text:
            return False
        ring = KeyRing.from_json(text, self.keys_url)
        self._ring, self._text = ring, text
        return True

    def key_names(self) -> list[str]:
        return [] if self._ring is None else [k.name for k in self._ring.keys]

    def _key(self, token: str) -> ApiKey | None:
        return None if self._ring is None else self._ring.identify(token)

    def inference(self, authorization: str | None) -> Caller:
        """The caller of a generation, model list or tokenizer call; AuthError (401 no or unknown
        key, 403 an admin key) or RateLimited (429) otherwise. Admits one request."""
        if not self.enabled:
            return Caller()
        key = self._key(bearer(authorization))
        if key is None:
            raise AuthError(401, "the API key is not valid (send 'Authorization: Bearer <key>')")
        if key.role != "inference":
            raise AuthError(403, f"API key {key.name!r} is an {key.role} key; inference needs an inference key")
        return Caller(key)

    def admin(self, authorization: str | None) -> Caller:
        """The caller of an admin call: the admin token (every adapter) or an admin key."""
        if not self.enabled:
            self._admin.check(authorization)
            return Caller()
        token = bearer(authorization)
        if self._admin.matches(token):
            return Caller()
        key = self._key(token)
        if key is None:
            raise AuthError(401, "the admin token or API key is not valid")
        if key.role != "admin":
            raise AuthError(403, f"API key {key.name!r} is an {key.role} key; the admin API needs an admin key")
        return Caller(key)
