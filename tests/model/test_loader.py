"""load_model reads single-file, sharded and bf16 checkpoints and names the culprit of bad ones."""

from __future__ import annotations

import json
import shutil
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from tests.helpers.paged import RowPages
from lora_runtime.errors import CheckpointError
from lora_runtime.model.loader import hf_name, load_model, transpose
from lora_runtime.model.sharding import make_mesh, stacked_layer_param
from tests.model.conftest import build_hf_model, save_checkpoint

Q_NAME = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def llama(hf_checkpoints):
    return hf_checkpoints["llama"]


@pytest.fixture
def copy(llama, tmp_path):
    """A writable copy of the single-file llama checkpoint."""
    _, path = llama
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst


def assert_params_equal(model, hf_model, dtype=np.float32):
    """Every parameter equals transformers' tensor of the same name (kernels transposed)."""
    hf = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    matched = 0
    for path, var in params:
        ours = np.asarray(var.get_value())
        assert ours.dtype == dtype, path
        layers = [(hf_name(path, i), ours[i]) for i in range(len(ours))] if stacked_layer_param(path) else \
            [(hf_name(path), ours)]
        for name, value in layers:
            ref = hf[name]
            np.testing.assert_array_equal(value.astype(np.float32), ref.T if path[-1] == "kernel" else ref)
            matched += 1
    assert matched == len([k for k in hf if not (k == "lm_head.weight" and model.lm_head is None)])


def prefill_logits(config, model, mesh, tokens: list[int]) -> np.ndarray:
    pages = RowPages(1, 16)
    cache = pages.cache(config, mesh)
    ids = jnp.asarray(tokens, jnp.int32)
    attn = pages.prefill(np.zeros(len(tokens), np.int32), np.arange(len(tokens)))
    hidden, _ = model(ids, jnp.arange(len(tokens), dtype=jnp.int32), cache, attn)
    return np.asarray(model.logits(hidden))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_single_file_checkpoint_loads_exact_weights(llama, scan_layers):
    hf_model, path = llama
    config, model = load_model(str(path), make_mesh(1), scan_layers=scan_layers)
    assert config.architecture == "llama" and config.dtype == "float32"
    assert model.scan_layers == scan_layers
    assert_params_equal(model, hf_model)


def test_sharded_index_checkpoint_loads(llama, tmp_path):
    hf_model, _ = llama
    path = save_checkpoint(hf_model, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (path / "model.safetensors").exists()
    _, model = load_model(str(path), make_mesh(2))
    assert_params_equal(model, hf_model)


def test_sharded_index_missing_shard_file(llama, tmp_path):
    hf_model, _ = llama
    path = save_checkpoint(hf_model, tmp_path / "sharded", max_shard_size="40KB")
    shard = sorted(p.name for p in path.glob("model-*.safetensors"))[1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_model(str(path), make_mesh(1))


def test_bf16_checkpoint_loads(llama, tmp_path):
    hf_model, _ = llama
    bf16 = build_hf_model("llama").to(torch.bfloat16)
    path = save_checkpoint(bf16, tmp_path / "bf16")
    mesh = make_mesh(1)
    config, model = load_model(str(path), mesh)
    assert config.dtype == "bfloat16"
    assert_params_equal(model, bf16, dtype=np.dtype(ml_dtypes.bfloat16))
    tokens = [5, 9, 17, 33, 64, 100]
    logits = prefill_logits(config, model, mesh, tokens)
    assert logits.dtype == np.float32
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0].numpy()
    # bf16 weights and activations against the f32 original
    assert np.max(np.abs(logits - ref)) / np.max(np.abs(ref)) < 0.05
    # an f32 override upcasts the bf16 weights exactly
    config32, model32 = load_model(str(path), mesh, dtype="float32")
    assert config32.dtype == "float32"
    assert_params_equal(model32, bf16)


def test_missing_checkpoint_file(tmp_path, llama):
    _, path = llama
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(str(tmp_path), make_mesh(1))


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(str(tmp_path), make_mesh(1))


def test_pickle_only_checkpoint_is_refused(copy):
    (copy / "model.safetensors").unlink()
    # Never loaded: the loader must refuse by name before opening it.
    (copy / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*pickle"):
        load_model(str(copy), make_mesh(1))


def test_missing_tensor(copy):
    tensors = load_file(copy / "model.safetensors")
    del tensors[Q_NAME]
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=Q_NAME):
        load_model(str(copy), make_mesh(1))


def test_wrong_shape(copy):
    tensors = load_file(copy / "model.safetensors")
    tensors[Q_NAME] = np.zeros((64, 32), np.float32)
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{Q_NAME}.*\(64, 32\), expected \(64, 64\)"):
        load_model(str(copy), make_mesh(1))


def test_unexpected_tensor(copy):
    tensors = load_file(copy / "model.safetensors")
    tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((96, 64), np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.up_proj.weight"):
        load_model(str(copy), make_mesh(1))


def test_rotary_inv_freq_is_ignored(copy, llama):
    tensors = load_file(copy / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)
    save_file(tensors, copy / "model.safetensors")
    _, model = load_model(str(copy), make_mesh(1))
    assert_params_equal(model, llama[0])


def test_tied_checkpoint_may_carry_an_lm_head_copy(hf_checkpoints, tmp_path):
    hf_model, path = hf_checkpoints["qwen3"]
    dst = shutil.copytree(path, tmp_path / "tied")
    tensors = load_file(dst / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, dst / "model.safetensors")
    config, model = load_model(str(dst), make_mesh(1))
    assert config.tie_word_embeddings and model.lm_head is None
    assert_params_equal(model, hf_model)


def test_unsupported_architecture(copy):
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="FalconForCausalLM"):
        load_model(str(copy), make_mesh(1))


def test_corrupt_safetensors_header(copy):
    (copy / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="model.safetensors.*header_len"):
        load_model(str(copy), make_mesh(1))


def test_a_mesh_wider_than_the_kv_heads_holds_each_kv_head_on_as_many_devices(llama):
    """2 kv heads over 4 devices: each device holds one copy of one head (head h on devices
    2h and 2h + 1), with the same logits as one device."""
    hf_model, path = llama
    config, model = load_model(str(path), make_mesh(4))
    assert (config.num_kv_heads, config.kv_head_copies, config.checkpoint_kv_heads) == (4, 2, 2)
    d = config.head_dim
    ref = hf_model.state_dict()["model.layers.1.self_attn.k_proj.weight"].numpy().T  # [in, 2 * d]
    held = np.asarray(model.layers.self_attn.k_proj.kernel[...])[1]  # [in, 4 * d]
    for copy_head, head in enumerate((0, 0, 1, 1)):
        np.testing.assert_array_equal(held[:, copy_head * d:(copy_head + 1) * d], ref[:, head * d:(head + 1) * d])
    kernel = model.layers.self_attn.v_proj.kernel[...]
    assert {s.data.shape[-1] for s in kernel.addressable_shards} == {d}  # one head's columns per device
    _, single = load_model(str(path), make_mesh(1))
    tokens = [1, 5, 9, 3, 7, 2]
    np.testing.assert_allclose(prefill_logits(config, model, make_mesh(4), tokens),
                               prefill_logits(single.config, single, make_mesh(1), tokens), rtol=1e-5, atol=1e-5)


def test_a_mesh_that_neither_divides_nor_copies_the_heads_is_refused(llama):
    import dataclasses

    _, path = llama
    with pytest.raises(CheckpointError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        load_model(str(path), make_mesh(3))
    config = dataclasses.replace(load_model(str(path), make_mesh(1))[0], num_heads=24, num_kv_heads=8)
    with pytest.raises(CheckpointError, match="tensor_parallel_size=6 neither divides num_key_value_heads=8"):
        config.for_tensor_parallel(6)


def test_tensor_parallel_slices(hf_checkpoints):
    """Each device holds only its slice: column-parallel out, row-parallel in, vocab split."""
    hf_model, path = hf_checkpoints["qwen2"]
    _, model = load_model(str(path), make_mesh(4))
    attn, mlp = model.layers.self_attn, model.layers.mlp  # stacked: every layer on a leading axis
    layers = model.config.num_layers
    expected = {
        "q": (attn.q_proj.kernel[...], (layers, 64, 16)),
        "q_bias": (attn.q_proj.bias[...], (layers, 16)),
        "o": (attn.o_proj.kernel[...], (layers, 16, 64)),
        "down": (mlp.down_proj.kernel[...], (layers, 24, 64)),
        "embed": (model.embed_tokens.embedding[...], (32, 64)),
        "norm": (model.norm.scale[...], (64,)),
    }
    for name, (array, shard_shape) in expected.items():
        assert {s.data.shape for s in array.addressable_shards} == {shard_shape}, name
        assert len(array.sharding.device_set) == 4, name
    ref = hf_model.state_dict()["model.layers.0.self_attn.o_proj.weight"].numpy().T
    shard = next(s for s in attn.o_proj.kernel[...].addressable_shards if s.index[1].start == 16)
    np.testing.assert_array_equal(np.asarray(shard.data)[0], ref[16:32])
    assert model.embed_tokens.embedding[...].sharding.spec == P("tensor", None)


@pytest.mark.parametrize("source, target", [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                                            ("float16", "float32")])
def test_the_tiled_transpose_is_the_transpose(source, target):
    """Kernels are stored [out, in]: the loader transposes them tile by tile on every core, over
    edges that are not whole tiles and over a column slice of the file (one device's shard)."""
    full = np.random.default_rng(0).standard_normal((700, 530)).astype(source)
    x = full[:, 17:530]  # not contiguous
    got = transpose(x, np.dtype(target))
    assert got.flags.c_contiguous and got.dtype == np.dtype(target) and got.shape == (513, 700)
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(x.T.astype(target)).view(np.uint8))
