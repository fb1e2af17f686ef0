"""Fetches adapter files through fsspec (plain path, file://, gs://, memory://) under a policy.

Only `adapter_config.json` and `adapter_model.safetensors` are read; sizes are checked
before the bytes are fetched, so an oversized adapter costs one metadata call.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec

from lora_runtime.errors import AdapterSourceError, InvalidAdapterError
from lora_runtime.lora.adapter import LoRAAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
SCHEMES: tuple[str, ...] = ("file", "gs", "memory")


def _storage_errors() -> tuple[type[BaseException], ...]:
    """What a storage backend raises when it cannot read: OS and network errors, and the HTTP
    errors of gcsfs (a 5xx after its retries, a 403)."""
    errors: tuple[type[BaseException], ...] = (OSError, ValueError, TimeoutError)
    try:
        from gcsfs.retry import HttpError
    except ImportError:
        return errors
    return errors + (HttpError,)


STORAGE_ERRORS = _storage_errors()


@dataclasses.dataclass(frozen=True)
class SourcePolicy:
    """Where adapters may come from and how large they may be.

    `allowed_roots` are URL prefixes (any scheme in SCHEMES); None allows any URL of
    those schemes. `storage_options` holds fsspec options per scheme, e.g.
    `{"gs": {"token": "anon"}}` for a GCS emulator.
    """

    allowed_roots: list[str] | None
    max_adapter_bytes: int
    storage_options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.max_adapter_bytes <= 0:
            raise ValueError(f"max_adapter_bytes={self.max_adapter_bytes} must be positive")
        for root in self.allowed_roots or ():
            split_url(root)


@dataclasses.dataclass(frozen=True)
class AdapterFiles:
    """The raw bytes of an adapter's two files."""

    url: str
    config: bytes
    weights: bytes

    @property
    def nbytes(self) -> int:
        return len(self.config) + len(self.weights)


def split_url(url: str) -> tuple[str, str]:
    """(scheme, normalized path) of a URL; plain paths are local files. `..` is resolved."""
    if not isinstance(url, str) or not url:
        raise AdapterSourceError(f"adapter source {url!r} must be a non-empty string")
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    if scheme not in SCHEMES:
        raise AdapterSourceError(f"adapter source {url!r} has scheme {scheme!r}; allowed: {list(SCHEMES)}")
    if scheme == "file":
        # realpath also resolves symlinks, so a link cannot lead out of an allowed root.
        path = os.path.realpath(os.path.abspath(rest))
    else:
        path = posixpath.normpath("/" + rest.lstrip("/"))
        if scheme == "gs":
            path = path.lstrip("/")
    return scheme, path.rstrip("/") or "/"


def check_url(url: str, policy: SourcePolicy) -> tuple[str, str]:
    """(scheme, path) of an allowed URL; AdapterSourceError naming the URL and roots otherwise."""
    scheme, path = split_url(url)
    if policy.allowed_roots is None:
        return scheme, path
    for root in policy.allowed_roots:
        r_scheme, r_path = split_url(root)
        if r_scheme == scheme and (path == r_path or path.startswith(r_path.rstrip("/") + "/")):
            return scheme, path
    raise AdapterSourceError(
        f"adapter source {url!r} (resolved to {scheme}://{path}) is outside allowed_roots={policy.allowed_roots}"
    )


def read_adapter_files(url: str, policy: SourcePolicy) -> AdapterFiles:
    """Reads the two adapter files at `url` after checking the policy and sizes."""
    scheme, path = check_url(url, policy)
    fs = fsspec.filesystem(scheme, **dict(policy.storage_options.get(scheme, {})))
    try:
        fs.invalidate_cache(path)
        sizes = {f: _size(fs, posixpath.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)}
        if sizes[WEIGHTS_FILE] is None and _size(fs, posixpath.join(path, PICKLE_FILE)) is not None:
            raise InvalidAdapterError(
                f"adapter at {url!r} has only {PICKLE_FILE} (a pickle, never loaded); save it as {WEIGHTS_FILE}"
            )
        if all(s is None for s in sizes.values()):
            raise AdapterSourceError(f"no adapter files ({CONFIG_FILE}, {WEIGHTS_FILE}) at {url!r}")
        for f, s in sizes.items():
            if s is None:
                raise InvalidAdapterError(f"adapter at {url!r} is missing {f}")
        _check_size(url, sum(sizes.values()), policy)
        config = fs.cat_file(posixpath.join(path, CONFIG_FILE))
        weights = fs.cat_file(posixpath.join(path, WEIGHTS_FILE))
    except (InvalidAdapterError, AdapterSourceError):
        raise
    except STORAGE_ERRORS as e:
        raise AdapterSourceError(f"cannot read adapter at {url!r}: {type(e).__name__}: {e}") from e
    # Files may change between the size check and the read.
    _check_size(url, len(config) + len(weights), policy)
    return AdapterFiles(url=url, config=config, weights=weights)


def load_adapter(name: str, url: str, policy: SourcePolicy, model_config, max_lora_rank: int) -> LoRAAdapter:
    """Fetches, parses and validates the adapter `name` stored at `url`."""
    files = read_adapter_files(url, policy)
    return LoRAAdapter.parse(name, files.config, files.weights, model_config, max_lora_rank)


def _size(fs, path: str) -> int | None:
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    if info.get("type") == "directory":
        return None
    return int(info["size"])


def _check_size(url: str, nbytes: int, policy: SourcePolicy) -> None:
    if nbytes > policy.max_adapter_bytes:
        raise AdapterSourceError(
            f"adapter at {url!r} is {nbytes} bytes, over max_adapter_bytes={policy.max_adapter_bytes}"
        )
