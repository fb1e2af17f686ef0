"""Test-session setup: 4 fake CPU devices so tensor-parallel tests run anywhere.

XLA reads the device count once, at the first JAX operation, so it is set here,
before any test module imports jax.
"""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile several thousand small programs that then run for milliseconds: LLVM's
# optimization of the generated CPU code is most of XLA's compile time for them and buys
# them nothing (the suite takes about a quarter less). Numerics do not change: no fast
# math either way. The processes tests start (Ray's, the two-process replica's) get the
# same flags (COMPILE_FLAGS), benchmarks none of them.
COMPILE_FLAGS = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMPILE_FLAGS}".strip()
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
# gcsfs reads this once, at import: with it on, recent gcsfs first makes a gRPC
# bucket-type probe that hangs against the GCS emulator. Any test may import gcsfs first.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# One persistent compilation cache for the whole session (this process and the Ray workers
# it starts inherit it): engines built alike in different tests read each other's compiled
# steps instead of compiling them again. Removed at exit; a test that needs its own sets
# compilation_cache_dir.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="multilora-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (`-n 2 --dist loadgroup`, as CI runs): a test file's tests run in one
    worker, so its module fixtures (checkpoints, PEFT references) are made once, and every
    integration test runs in one worker, so the session has one Ray cluster."""
    for item in items:
        path = item.nodeid.split("::")[0]
        group = "integration" if path.startswith("tests/integration/") else path
        item.add_marker(pytest.mark.xdist_group(group))
