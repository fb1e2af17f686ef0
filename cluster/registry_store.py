"""Durable adapter registry: one versioned JSON document at an fsspec URL.

The document is ``{"format": 2, "version": int, "adapters": {name: {"source", "version",
"pinned", "base_model", "base_fingerprint", ...}}}``. Every change bumps ``version``; an
adapter's own ``version`` is the registry version of its last (re-)registration, so a
replica that sees a new entry version knows the adapter's files may have changed.
``base_model`` and ``base_fingerprint`` name the base model the adapter was validated
against (cluster/base_model.py).

Format 1 documents (entries without a base model) still load; their entries have no base
model until a deployment re-validates them (``AdminActor.adopt_unassigned``). Saving
writes format 2, which older versions of this server refuse to read.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from dataclasses import dataclass, field

import fsspec

from cluster.base_model import FINGERPRINT_KEY

FORMAT = 2
READABLE_FORMATS = (1, 2)
_REQUIRED = ("source", "version", "pinned")


@dataclass
class RegistryDoc:
    """An in-memory registry snapshot; entries map adapter name to its record."""

    version: int = 0
    adapters: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {"format": FORMAT, "version": self.version, "adapters": self.adapters},
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, url: str) -> "RegistryDoc":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"registry at {url!r} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or data.get("format") not in READABLE_FORMATS:
            raise ValueError(
                f"registry at {url!r} has format={data.get('format') if isinstance(data, dict) else None!r}, "
                f"expected one of {READABLE_FORMATS}"
            )
        version = data.get("version")
        adapters = data.get("adapters")
        if not isinstance(version, int) or not isinstance(adapters, dict):
            raise ValueError(f"registry at {url!r} lacks an int version and an adapters map")
        for name, entry in adapters.items():
            if not isinstance(entry, dict):
                raise ValueError(f"registry at {url!r}: adapter {name!r} is {entry!r}, not a map")
            missing = set(_REQUIRED) - set(entry)
            if missing:
                raise ValueError(f"registry at {url!r}: adapter {name!r} lacks {sorted(missing)}")
            fingerprint = entry.get(FINGERPRINT_KEY)
            if fingerprint is not None and not (isinstance(fingerprint, str) and fingerprint.startswith("sha256:")):
                raise ValueError(f"registry at {url!r}: adapter {name!r} has {FINGERPRINT_KEY}={fingerprint!r}")
        return cls(version=version, adapters=adapters)

    def copy(self) -> "RegistryDoc":
        return RegistryDoc(version=self.version, adapters=copy.deepcopy(self.adapters))


class RegistryStore:
    """Reads and writes the registry document at ``url`` (local path or fsspec URL).

    Local files are written to a temporary name and renamed, so a crash never leaves a
    half-written registry; object stores (gs://, s3://) replace an object atomically
    on a single put.
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        if not url:
            raise ValueError(f"registry {url=} must be a path or an fsspec URL")
        self.url = url
        self._fs, self._path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self._local = "file" in _protocols(self._fs)

    def load(self) -> RegistryDoc:
        """The stored document, or an empty one (version 0) if none exists yet."""
        if not self._fs.exists(self._path):
            return RegistryDoc()
        with self._fs.open(self._path, "rb") as f:
            text = f.read().decode("utf-8")
        return RegistryDoc.from_json(text, self.url)

    def save(self, doc: RegistryDoc) -> None:
        data = doc.to_json().encode("utf-8")
        if self._local:
            parent = os.path.dirname(self._path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            tmp = f"{self._path}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        else:
            self._fs.pipe_file(self._path, data)


def merged_store_url(registry_url: str) -> str:
    """Where the admin actor writes the files of merged adapters: beside the registry
    document, in a folder named for it (``.../registry.json`` -> ``.../registry-merged``)."""
    head, _, leaf = registry_url.rstrip("/").rpartition("/")
    stem = leaf[:-5] if leaf.endswith(".json") else leaf
    return f"{head}/{stem}-merged" if head else f"{stem}-merged"


def _protocols(fs) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
