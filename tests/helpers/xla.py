"""XLA_FLAGS for the processes tests start: the session's flags (tests/conftest.py), less its
fake host device count, which each such process sets for itself or takes from its placement."""

from __future__ import annotations

import os

from deployments.placement import without_host_device_count


def child_xla_flags() -> str:
    """The session's XLA_FLAGS without its host device count ("" if nothing else is set)."""
    return without_host_device_count(os.environ.get("XLA_FLAGS", ""))
