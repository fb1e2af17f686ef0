"""Bearer tokens: the admin token check (constant-time compare, closed when no token is set)."""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass


class AuthError(Exception):
    """An admin call was refused; ``status_code`` is 401 (no/garbled token) or 403."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message


def bearer(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; AuthError(401) if there is none."""
    if not authorization:
        raise AuthError(401, "missing Authorization header; expected 'Bearer <token>'")
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise AuthError(401, f"Authorization scheme {scheme!r} is not 'Bearer <token>'")
    return given.strip()


@dataclass(frozen=True)
class AdminAuth:
    """Checks ``Authorization: Bearer <token>`` against the token in env var ``env_var``."""

    env_var: str
    token: str | None

    @classmethod
    def from_env(cls, env_var: str) -> "AdminAuth":
        token = os.environ.get(env_var) or None
        return cls(env_var=env_var, token=token)

    def check(self, authorization: str | None) -> None:
        """Raises AuthError unless ``authorization`` carries the configured token."""
        if self.token is None:
            # Refuse rather than run an open admin API when the operator forgot the token.
            raise AuthError(
                403,
                f"admin API is disabled: no token configured in env var {self.env_var!r}",
            )
        if not self.matches(bearer(authorization)):
            raise AuthError(403, "admin token is not valid")

    def matches(self, token: str) -> bool:
        """Whether ``token`` is the configured admin token (constant time; False when none is set)."""
        return self.token is not None and hmac.compare_digest(token.encode(), self.token.encode())
