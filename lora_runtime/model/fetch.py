"""Local copies of base-model checkpoints (and tokenizer folders) named by fsspec URLs (gs://, s3://, memory://, file://).

The loader memory-maps local files, so a checkpoint given as a URL is copied once into a
cache folder keyed by the URL; the copy appears atomically (a partial download is never
used) and concurrent replicas on one host share it. A new checkpoint wants a new URL:
an existing copy is not compared with its source again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

import fsspec

from lora_runtime.errors import CheckpointError

# What a serving replica needs besides the weights; anything else in the folder is skipped.
METADATA_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
    }
)
# The files of a tokenizer folder (the `tokenizer` app arg).
TOKENIZER_FILES = frozenset(
    {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
)
_DONE = ".complete"


def default_cache_dir() -> str:
    return os.environ.get(
        "MULTILORA_CHECKPOINT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "multilora-serve", "checkpoints")
    )


def local_checkpoint(
    model: str,
    *,
    weights: bool = True,
    cache_dir: str | None = None,
    storage_options: dict | None = None,
) -> str:
    """A local directory holding the checkpoint `model` (a path, or a URL copied once).

    With `weights=False` only the metadata files are copied (enough to validate adapters).
    """
    def wanted(names: set[str]) -> list[str]:
        if "config.json" not in names:
            raise CheckpointError(f"checkpoint URL {model!r} has no config.json (found {sorted(names)[:10]})")
        keep = sorted(n for n in names if n in METADATA_FILES or (weights and n.endswith(".safetensors")))
        if weights and not any(n.endswith(".safetensors") for n in keep):
            raise CheckpointError(f"checkpoint URL {model!r} has no .safetensors weights (found {sorted(names)[:10]})")
        return keep

    return _local_copy(model, "checkpoint", wanted, "" if weights else "-metadata", cache_dir, storage_options)


def local_tokenizer(
    tokenizer: str,
    *,
    cache_dir: str | None = None,
    storage_options: dict | None = None,
) -> str:
    """A local directory holding the tokenizer folder `tokenizer` (a path, or a URL copied once)."""
    def wanted(names: set[str]) -> list[str]:
        if "tokenizer.json" not in names:
            raise CheckpointError(f"tokenizer URL {tokenizer!r} has no tokenizer.json (found {sorted(names)[:10]})")
        return sorted(n for n in names if n in TOKENIZER_FILES)

    return _local_copy(tokenizer, "tokenizer", wanted, "-tokenizer", cache_dir, storage_options)


def _local_copy(url: str, what: str, wanted, key_suffix: str, cache_dir: str | None,
                storage_options: dict | None) -> str:
    """`url` itself when local, else a cached copy of the files `wanted(names)` picks from it."""
    if "://" not in url:
        return url
    if url.startswith("file://"):
        return url[len("file://") :]
    key = hashlib.sha256(url.encode()).hexdigest()[:20] + key_suffix
    parent = cache_dir or default_cache_dir()
    dest = os.path.join(parent, key)
    if os.path.isfile(os.path.join(dest, _DONE)):
        return dest
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        names = {os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
    except (ValueError, ImportError) as e:
        raise CheckpointError(f"{what} URL {url!r} cannot be opened: {e}") from None
    except FileNotFoundError:
        raise CheckpointError(f"{what} URL {url!r} does not exist") from None
    files = wanted(names)
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(dir=parent, prefix=key + ".partial-")
    try:
        for name in files:
            fs.get(f"{root.rstrip('/')}/{name}", os.path.join(partial, name))
        with open(os.path.join(partial, _DONE), "w") as f:
            f.write(url)
        try:
            os.rename(partial, dest)
        except OSError:  # another process finished the same copy first: use theirs
            if not os.path.isfile(os.path.join(dest, _DONE)):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest
