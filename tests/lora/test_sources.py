"""Adapter sources: local path, file://, memory://, gs:// (GCS emulator), policy refusals."""

from __future__ import annotations

import os
import shutil

import fsspec
import numpy as np
import pytest

from lora_runtime.errors import AdapterSourceError, InvalidAdapterError
from lora_runtime.lora.sources import SourcePolicy, load_adapter, read_adapter_files

CAP = 1 << 22


def assert_same_adapter(a, b):
    assert a.modules == b.modules and a.scaling == b.scaling and a.rank == b.rank
    for key, w in a.weights.items():
        np.testing.assert_array_equal(b.weights[key].a, w.a)
        np.testing.assert_array_equal(b.weights[key].b, w.b)


@pytest.fixture
def local(adapter_dirs, model_config):
    path = adapter_dirs["r8_rslora"]
    return path, load_adapter("r8", str(path), SourcePolicy(None, CAP), model_config, 16)


def test_local_path_and_file_url(local, model_config):
    path, adapter = local
    assert adapter.modules == {(layer, m) for layer in (0, 1) for m in ("q_proj", "v_proj", "down_proj")}
    via_url = load_adapter("r8", f"file://{path}", SourcePolicy([f"file://{path.parent}"], CAP), model_config, 16)
    assert_same_adapter(adapter, via_url)


def test_memory_url(local, model_config):
    path, adapter = local
    fs = fsspec.filesystem("memory")
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        fs.pipe_file(f"/adapters/r8/{f}", (path / f).read_bytes())
    got = load_adapter("r8", "memory://adapters/r8", SourcePolicy(["memory://adapters"], CAP), model_config, 16)
    assert_same_adapter(adapter, got)


def test_gs_url_on_emulator(local, gcs, model_config):
    path, adapter = local
    url = gcs.upload_dir(path, "team-a/r8")
    policy = SourcePolicy([f"gs://{gcs.bucket}/team-a"], CAP, storage_options=gcs.storage_options)
    assert_same_adapter(adapter, load_adapter("r8", url, policy, model_config, 16))
    with pytest.raises(AdapterSourceError, match="no adapter files"):
        read_adapter_files(f"gs://{gcs.bucket}/team-a/absent", policy)
    other = SourcePolicy([f"gs://{gcs.bucket}/team-b"], CAP, storage_options=gcs.storage_options)
    with pytest.raises(AdapterSourceError, match="outside allowed_roots"):
        read_adapter_files(url, other)


@pytest.mark.parametrize("template", [
    "{root}-sibling/r8",  # a prefix of the root's name is not inside it
    "{root}/../outside",  # `..` climbs out of the root
    "file://{root}/../outside",
    "memory://allowed/r8",  # right path shape, wrong scheme
    "{root}/a/../../outside",
])
def test_urls_outside_the_roots_are_refused(template, tmp_path, local):
    root = tmp_path / "allowed"
    root.mkdir()
    shutil.copytree(local[0], tmp_path / "outside")
    url = template.format(root=root)
    with pytest.raises(AdapterSourceError) as e:
        read_adapter_files(url, SourcePolicy([str(root)], CAP))
    assert repr(url) in str(e.value) and "allowed_roots" in str(e.value)


def test_symlink_out_of_a_root_is_refused(tmp_path, local):
    root = tmp_path / "allowed"
    root.mkdir()
    os.symlink(local[0], root / "link")
    with pytest.raises(AdapterSourceError, match="outside allowed_roots"):
        read_adapter_files(str(root / "link"), SourcePolicy([str(root)], CAP))


@pytest.mark.parametrize("url", ["http://example.com/a", "s3://bucket/a", "hdfs:///a"])
def test_unsupported_schemes_are_refused(url):
    with pytest.raises(AdapterSourceError, match=f"{url!r} has scheme"):
        read_adapter_files(url, SourcePolicy(None, CAP))


def test_size_cap(local):
    path, _ = local
    size = sum((path / f).stat().st_size for f in ("adapter_config.json", "adapter_model.safetensors"))
    with pytest.raises(AdapterSourceError) as e:
        read_adapter_files(str(path), SourcePolicy(None, size - 1))
    assert f"is {size} bytes, over max_adapter_bytes={size - 1}" in str(e.value) and repr(str(path)) in str(e.value)
    assert read_adapter_files(str(path), SourcePolicy(None, size)).nbytes == size


def test_reads_only_the_adapter_files(local, tmp_path, model_config):
    """A large extra file (e.g. optimizer state) beside the adapter neither counts nor is read."""
    path, adapter = local
    d = tmp_path / "with_extra"
    shutil.copytree(path, d)
    (d / "optimizer.pt").write_bytes(b"\0" * (CAP + 1))
    assert_same_adapter(adapter, load_adapter("r8", str(d), SourcePolicy(None, CAP), model_config, 16))


def test_pickle_bin_is_refused(local, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(local[0] / "adapter_config.json", d)
    (d / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(InvalidAdapterError, match="adapter_model.bin"):
        read_adapter_files(str(d), SourcePolicy(None, CAP))


def test_missing_files(local, tmp_path):
    d = tmp_path / "half"
    d.mkdir()
    shutil.copy(local[0] / "adapter_config.json", d)
    with pytest.raises(InvalidAdapterError, match="missing adapter_model.safetensors"):
        read_adapter_files(str(d), SourcePolicy(None, CAP))
    with pytest.raises(AdapterSourceError, match="no adapter files"):
        read_adapter_files(str(tmp_path / "nowhere"), SourcePolicy(None, CAP))


def test_policy_validates_itself():
    with pytest.raises(ValueError, match="max_adapter_bytes=0"):
        SourcePolicy(None, 0)
    with pytest.raises(AdapterSourceError, match="ftp"):
        SourcePolicy(["ftp://host/a"], CAP)
