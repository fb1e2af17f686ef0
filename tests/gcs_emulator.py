"""An in-process GCS emulator for tests, and helpers to put adapter directories in it.

gcsfs talks to it through STORAGE_EMULATOR_HOST; the gRPC bucket-type probe of recent
gcsfs hangs against the emulator, so GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is turned off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import fsspec


@dataclasses.dataclass(frozen=True)
class GcsEmulator:
    """A running emulator: its endpoint and the bucket it serves."""

    endpoint: str  # http://127.0.0.1:PORT
    bucket: str

    @property
    def storage_options(self) -> dict[str, dict[str, str]]:
        """SourcePolicy.storage_options for gs:// against this emulator."""
        return {"gs": {"token": "anon"}}

    def filesystem(self):
        return fsspec.filesystem("gs", token="anon")

    def upload_dir(self, local_dir: Path, prefix: str) -> str:
        """Copies the files of `local_dir` under gs://bucket/prefix/; returns that URL."""
        fs = self.filesystem()
        url = f"{self.bucket}/{prefix.strip('/')}"
        for f in sorted(Path(local_dir).iterdir()):
            if f.is_file():
                fs.pipe_file(f"{url}/{f.name}", f.read_bytes())
        fs.invalidate_cache()
        return f"gs://{url}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_gcs_emulator(bucket: str = "adapters") -> Iterator[GcsEmulator]:
    """Starts an in-memory emulator on a free port with `bucket`, sets the env gcsfs reads."""
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    try:
        yield GcsEmulator(endpoint=endpoint, bucket=bucket)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
