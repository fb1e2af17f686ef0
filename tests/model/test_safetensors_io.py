"""Our safetensors header parser and memory maps agree with the safetensors library."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lora_runtime.errors import CheckpointError
from lora_runtime.model.safetensors_io import read_header


@pytest.fixture
def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.standard_normal((6, 5)).astype(np.float32),
        "b.weight": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
        "c.bias": rng.standard_normal((7,)).astype(np.float16),
        "d.index": np.arange(9, dtype=np.int64).reshape(3, 3),
    }


def test_read_header_and_memmap_match_safetensors(tmp_path, tensors):
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "np"})
    infos = read_header(str(path))
    assert sorted(infos) == sorted(tensors)
    reference = load_file(path)
    for name, info in infos.items():
        data = info.memmap()
        assert isinstance(data, np.memmap)  # mapped, not read into memory
        assert info.shape == tensors[name].shape and info.dtype == tensors[name].dtype
        np.testing.assert_array_equal(np.asarray(data), reference[name])
    # A slice reads only its own part and keeps its values.
    np.testing.assert_array_equal(infos["a.weight"].memmap()[2:4, 1:3], tensors["a.weight"][2:4, 1:3])


def test_truncated_file(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="short.safetensors.*truncated"):
        read_header(str(path))


def test_offsets_beyond_the_file(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(CheckpointError, match="'w'.*data_offsets"):
        read_header(str(path))


def test_unsupported_dtype(tmp_path):
    header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path = tmp_path / "f8.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 2)
    with pytest.raises(CheckpointError, match="F8_E4M3"):
        read_header(str(path))


def test_corrupt_header_json(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(CheckpointError, match="bad.safetensors.*corrupt header"):
        read_header(str(path))
