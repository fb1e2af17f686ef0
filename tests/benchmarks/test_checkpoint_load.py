"""The checkpoint_load benchmark at a tiny setting, so it keeps working."""

import re

import numpy as np
from safetensors.numpy import load_file

from benchmarks import checkpoint_load, common


def test_it_loads_a_tiny_checkpoint_and_prints_its_speed(capsys):
    checkpoint_load.main(["--widths", "small", "--layers", "2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    values = dict(re.findall(r"(\w+)=([\d.]+)", last))
    assert set(values) == {"load_s", "load_gb_per_s", "host_share"}
    assert float(values["load_s"]) > 0 and 0 < float(values["host_share"]) <= 1


def test_a_tiled_checkpoint_repeats_one_block_in_its_dtype(tmp_path, monkeypatch):
    block = 1 << 16
    monkeypatch.setattr(common, "TILED_VALUES", block)
    shape = dict(hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=1000, dtype="bfloat16")
    out = common.write_random_checkpoint(tmp_path, tiled=True, layers=1, **shape)
    tensors = load_file(str(out / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]  # 256000 values: past one block
    assert embed.dtype == np.dtype("bfloat16") and embed.shape == (1000, 256)
    flat = embed.reshape(-1).view(np.uint16)
    np.testing.assert_array_equal(flat[block:], flat[: flat.size - block])
    assert len(np.unique(flat[:block])) > 1000  # random, not a constant
    assert 0.015 < float(np.std(embed[:100].astype(np.float32))) < 0.025
