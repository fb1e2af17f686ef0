"""Checkpoints named by URL: copied once into the cache, then loaded like a local folder."""

from pathlib import Path

import fsspec
import numpy as np
import pytest

from lora_runtime.errors import CheckpointError
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.fetch import local_checkpoint
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from tests.gcs_emulator import run_gcs_emulator
from tests.helpers.checkpoints import save_tiny_llama


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    ckpt = save_tiny_llama(tmp_path_factory.mktemp("fetch_src") / "tiny-llama")
    (ckpt / "pytorch_model.bin").write_bytes(b"never copied")  # pickles are not fetched
    return ckpt


def _upload(fs, checkpoint: Path, root: str) -> None:
    for f in checkpoint.iterdir():
        fs.pipe_file(f"{root}/{f.name}", f.read_bytes())


def test_memory_url_is_copied_once_and_loads(checkpoint, tmp_path):
    fs = fsspec.filesystem("memory")
    _upload(fs, checkpoint, "/models/tiny-llama")
    local = local_checkpoint("memory://models/tiny-llama", cache_dir=str(tmp_path))
    names = {p.name for p in Path(local).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "pytorch_model.bin" not in names and not [n for n in names if ".partial" in n]
    _, model = load_model(local, make_mesh(1))
    _, ref = load_model(str(checkpoint), make_mesh(1))
    np.testing.assert_array_equal(model.embed_tokens.embedding[...], ref.embed_tokens.embedding[...])
    # A second call reuses the copy even if the source is gone.
    fs.rm("/models/tiny-llama", recursive=True)
    assert local_checkpoint("memory://models/tiny-llama", cache_dir=str(tmp_path)) == local


def test_metadata_only_copy_skips_weights(checkpoint, tmp_path):
    fs = fsspec.filesystem("memory")
    _upload(fs, checkpoint, "/models/meta-only")
    local = local_checkpoint("memory://models/meta-only", weights=False, cache_dir=str(tmp_path))
    assert not list(Path(local).glob("*.safetensors"))
    assert ModelConfig.from_pretrained(local) == ModelConfig.from_pretrained(str(checkpoint))


def test_gs_url_on_the_emulator(checkpoint, tmp_path):
    with run_gcs_emulator(bucket="models") as gcs:
        url = gcs.upload_dir(checkpoint, "llama/tiny")
        local = local_checkpoint(url, cache_dir=str(tmp_path), storage_options={"token": "anon"})
        assert ModelConfig.from_pretrained(local) == ModelConfig.from_pretrained(str(checkpoint))
        assert (Path(local) / "model.safetensors").stat().st_size == (checkpoint / "model.safetensors").stat().st_size


def test_local_paths_and_file_urls_are_used_in_place(checkpoint):
    assert local_checkpoint(str(checkpoint)) == str(checkpoint)
    assert local_checkpoint(f"file://{checkpoint}") == str(checkpoint)


@pytest.mark.parametrize(
    "files, url, match",
    [
        ({"model.safetensors": b"x"}, "memory://bad/no-config", "has no config.json"),
        ({"config.json": b"{}"}, "memory://bad/no-weights", "has no .safetensors weights"),
        ({}, "memory://bad/missing", "does not exist"),
        ({}, "nosuchscheme://x/y", "cannot be opened"),
    ],
)
def test_bad_checkpoint_urls_name_the_problem(tmp_path, files, url, match):
    fs = fsspec.filesystem("memory")
    for name, data in files.items():
        fs.pipe_file(f"/{url.split('://')[1]}/{name}", data)
    with pytest.raises(CheckpointError, match=match):
        local_checkpoint(url, cache_dir=str(tmp_path))


def test_tokenizer_url_copies_only_the_tokenizer_files(checkpoint, tmp_path):
    from lora_runtime.model.fetch import local_tokenizer
    from lora_runtime.model.tokenizer import Tokenizer

    fs = fsspec.filesystem("memory")
    _upload(fs, checkpoint, "/tokenizers/tiny")
    local = local_tokenizer("memory://tokenizers/tiny", cache_dir=str(tmp_path))
    names = {p.name for p in Path(local).iterdir()} - {".complete"}
    assert names == {"tokenizer.json", "tokenizer_config.json"}
    text = "the quick brown fox"
    assert Tokenizer.from_pretrained(local).encode(text) == Tokenizer.from_pretrained(str(checkpoint)).encode(text)
    assert local_tokenizer(str(checkpoint)) == str(checkpoint)
    fs.pipe_file("/tokenizers/none/config.json", b"{}")
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        local_tokenizer("memory://tokenizers/none", cache_dir=str(tmp_path))
