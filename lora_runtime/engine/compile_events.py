"""XLA compilations counted from JAX's own monitoring events, per thread, and JAX's
persistent compilation cache.

Every executable JAX builds goes through one backend-compile event; one served from the
persistent cache also records a cache hit. A real compilation is the difference. Counts
are kept per thread so an engine counts what its own loop compiled, whatever other
engines in the process do.

A host callback running inside a compiled step (Pallas interpret mode evaluates a kernel
on the host that way) may itself compile JAX helpers, on whichever thread XLA runs the
callback on, the step's caller included. Those are the callback's, not a program the engine
dispatches, so they are counted apart (`callback_builds`): they never happen on TPU or GPU,
where the kernels are compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sys
import threading

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

logger = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_compiles: collections.Counter = collections.Counter()  # thread id -> backend compiles (hits included)
_hits: collections.Counter = collections.Counter()  # thread id -> persistent-cache hits
_seconds: collections.Counter = collections.Counter()  # thread id -> seconds spent in backend compiles
_in_callbacks: collections.Counter = collections.Counter()  # thread id -> compiles inside host callbacks
_installed = False
_CALLBACK_FILE = os.path.join("jax", "_src", "callback.py")


def _inside_host_callback() -> bool:
    """Whether this thread is running a host callback of a compiled computation."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CALLBACK_FILE):
            return True
        frame = frame.f_back
    return False


def _on_duration(event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        inside = _inside_host_callback()
        counter = _in_callbacks if inside else _compiles
        with _lock:
            counter[threading.get_ident()] += 1
            if not inside:
                _seconds[threading.get_ident()] += duration


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT and not _inside_host_callback():
        with _lock:
            _hits[threading.get_ident()] += 1


def install() -> None:
    """Registers the listeners (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        monitoring.register_event_duration_secs_listener(_on_duration)
        monitoring.register_event_listener(_on_event)
        _installed = True


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    builds: int  # executables built: compiled, or read from the persistent cache
    cache_hits: int  # of which read from the persistent cache
    seconds: float = 0.0  # spent building them (XLA's backend compile, or the cache read), summed over threads

    @property
    def compiled(self) -> int:
        """Executables XLA really compiled."""
        return self.builds - self.cache_hits

    def __add__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.builds + other.builds, self.cache_hits + other.cache_hits,
                             self.seconds + other.seconds)

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.builds - other.builds, self.cache_hits - other.cache_hits,
                             self.seconds - other.seconds)


def counts(thread_id: int | None = None) -> CompileCounts:
    """What JAX built on a thread (default: this one) since the listeners were installed."""
    install()
    tid = threading.get_ident() if thread_id is None else thread_id
    with _lock:
        return CompileCounts(_compiles[tid], _hits[tid], _seconds[tid])


def callback_builds() -> int:
    """Executables built inside host callbacks, on every thread of this process (in no other count)."""
    install()
    with _lock:
        return sum(_in_callbacks.values())


def process_counts() -> CompileCounts:
    """What JAX built on every thread of this process (warm-up compiles on several)."""
    install()
    with _lock:
        return CompileCounts(sum(_compiles.values()), sum(_hits.values()), sum(_seconds.values()))


def default_cache_dir() -> str:
    """JAX_COMPILATION_CACHE_DIR if set, else multilora/jax-compile under the user's cache
    (XDG_CACHE_HOME, else ~/.cache)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "multilora", "jax-compile")


def enable_persistent_cache(path: str | None, min_compile_seconds: float | None = None) -> str | None:
    """Points JAX's persistent compilation cache at `path` (created if missing); None or ""
    leaves the cache off. Executables that took at least `min_compile_seconds` to compile
    are written (None: JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS where set, else every one:
    JAX's own default of 1 s would leave about half of a warm-up's programs, the quick ones,
    to be compiled again on every restart); a restarted replica reads them instead of
    compiling. Returns the path used.

    The cache is trusted code: it must be writable by the serving user only. A URL (gs://...)
    goes to JAX as it is: JAX reads and writes it through its own file layer, so replicas
    restarted on other machines share it."""
    if not path:
        return None
    if "://" not in path:
        path = os.path.expanduser(path)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:  # a read-only home must not stop the replica: it compiles instead
            logger.warning("compilation cache %s unusable (%s); compiling without it", path, exc)
            return None
    if jax.config.jax_compilation_cache_dir != path:
        compilation_cache.set_cache_dir(path)
        compilation_cache.reset_cache()  # JAX opens its cache once: a new path needs a reset
    if min_compile_seconds is None and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        min_compile_seconds = 0.0
    if min_compile_seconds is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    return path
