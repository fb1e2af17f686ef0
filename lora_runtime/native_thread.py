"""The OS-level name of a Python thread, so `top -H`, `ps -L`, /proc/<pid>/task/<tid>/comm
and native profilers tell the engine loop, the adapter fetchers and the compilers apart
(Python before 3.14 leaves every thread it starts with its process's name)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15  # linux/prctl.h
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:  # no C library to call: threads keep their inherited names
        _libc = None


def name_native_thread(name: str | None = None) -> bool:
    """Names the calling thread at the OS level (`name`, else its Python name), cut to the
    15 bytes Linux keeps; returns whether the name was set (False off Linux)."""
    if _libc is None:
        return False
    raw = (name or threading.current_thread().name).encode(errors="replace")[:15]
    return _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
