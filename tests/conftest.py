"""Test-session setup: 4 fake CPU devices so tensor-parallel tests run anywhere.

XLA reads the device count once, at the first JAX operation, so it is set here,
before any test module imports jax.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
# gcsfs reads this once, at import: with it on, recent gcsfs first makes a gRPC
# bucket-type probe that hangs against the GCS emulator. Any test may import gcsfs first.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
