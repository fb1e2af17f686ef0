"""XLA_FLAGS for the processes tests start: the session's flags (tests/conftest.py), less its
fake host device count, which each such process sets for itself or takes from its placement."""

from __future__ import annotations

import os

HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def child_xla_flags() -> str:
    """The session's XLA_FLAGS without its host device count ("" if nothing else is set)."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != HOST_DEVICE_FLAG)
