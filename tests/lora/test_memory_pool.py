"""The device pool: layout, tensor-parallel sharding, slot writes with donation, one compile."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lora_runtime.lora import memory_pool
from lora_runtime.lora.adapter import LoRAAdapter
from lora_runtime.lora.memory_pool import LoRAMemoryPool, clear_slot, write_slot
from lora_runtime.model.lora_hook import GROUPS
from lora_runtime.model.sharding import make_mesh

R = 16


def parse(path, model_config):
    return LoRAAdapter.parse(path.name, (path / "adapter_config.json").read_bytes(),
                             (path / "adapter_model.safetensors").read_bytes(), model_config, R)


def make_pool(model_config, tp=1, num_slots=3, dtype="float32"):
    return LoRAMemoryPool.create(model_config, make_mesh(tp, jax.devices()[:tp]), num_slots=num_slots,
                                 max_lora_rank=R, dtype=dtype)


def test_layout_and_nbytes(model_config):
    pool = make_pool(model_config)
    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    a, b = pool.group(1, "qkv")
    assert a.shape == (3, 3 * R, c.hidden_size) and [x.shape for x in b] == [(3, R, q), (3, R, kv), (3, R, kv)]
    a, (b,) = pool.group(0, "down")
    assert a.shape == (3, R, c.intermediate_size) and b.shape == (3, R, c.hidden_size)
    per_slot_layer = (3 * R * c.hidden_size + R * (q + 2 * kv)  # qkv
                      + R * q + R * c.hidden_size  # o
                      + 2 * R * c.hidden_size + 2 * R * c.intermediate_size  # gate_up
                      + R * c.intermediate_size + R * c.hidden_size)  # down
    assert pool.nbytes == 4 * c.num_layers * 3 * per_slot_layer
    assert pool.slot_nbytes(0) == pool.nbytes // 3
    assert all(not np.asarray(x).any() for x in jax.tree_util.tree_leaves(pool))


def test_rows_and_term_slots_fill_whole_tiles_on_tpu(model_config):
    """On TPU a pooled array's second-minor axis fills whole 8-row tiles (A's n*R, B's R, the
    terms' slots): off the tile, the runtime stored the terms of 63 slots in another layout and
    every step copied them whole. Elsewhere the shapes are exact."""
    assert memory_pool.row_align_for("tpu") == 8 and memory_pool.row_align_for("gpu") == 1
    assert [memory_pool.aligned(n, 8) for n in (1, 8, 63, 64, 65)] == [8, 8, 64, 64, 72]
    mesh = make_mesh(1, jax.devices()[:1])
    kw = dict(num_slots=3, max_lora_rank=4, dtype="float32", dora=True, bias=True)
    exact, tiled = LoRAMemoryPool.create(model_config, mesh, **kw), LoRAMemoryPool.create(model_config, mesh,
                                                                                          row_align=8, **kw)
    assert exact.classes[0].rows == 4 and tiled.classes[0].rows == 8 and tiled.max_lora_rank == 4
    for pool, rows, slots in ((exact, 4, 3), (tiled, 8, 8)):
        a, bs = pool.stacked_group("qkv", 0)
        assert a.shape[1:3] == (3, 3 * rows) and {b.shape[1:3] for b in bs} == {(3, rows)}
        assert {x.shape[1] for x in jax.tree_util.tree_leaves((pool.scale, pool.shift))} == {slots}


def test_sharding_under_tp4(model_config):
    pool = make_pool(model_config, tp=4)
    for g, a, bs in zip(GROUPS, pool.a[0], pool.b[0]):
        column = g in ("qkv", "gate_up")
        assert a.sharding.spec == (P(None, None, None, None) if column else P(None, None, None, "tensor")), g
        assert a.addressable_shards[0].data.shape[-1] == (a.shape[-1] if column else a.shape[-1] // 4)
        for b in bs:
            assert b.sharding.spec == (P(None, None, None, "tensor") if column else P(None, None, None, None)), g
            assert b.addressable_shards[0].data.shape[-1] == (b.shape[-1] // 4 if column else b.shape[-1])


@pytest.mark.parametrize("tp", [1, 4])
def test_write_and_clear_slot(tp, model_config, adapter_dirs):
    pool = make_pool(model_config, tp=tp)
    specs = [x.sharding.spec for x in jax.tree_util.tree_leaves(pool)]
    w16 = parse(adapter_dirs["r16_pattern"], model_config).pool_weights(model_config, R, np.float32)
    w4 = parse(adapter_dirs["r4"], model_config).pool_weights(model_config, R, np.float32)
    pool = write_slot(pool, 2, w16)
    pool = write_slot(pool, 0, w4)
    assert [x.sharding.spec for x in jax.tree_util.tree_leaves(pool)] == specs
    for layer in range(model_config.num_layers):
        for g in GROUPS:
            a, bs = pool.group(layer, g)
            np.testing.assert_array_equal(np.asarray(a)[2], w16[g][0][layer])
            np.testing.assert_array_equal(np.asarray(a)[0], w4[g][0][layer])
            assert not np.asarray(a)[1].any()
            for b, want in zip(bs, w16[g][1]):
                np.testing.assert_array_equal(np.asarray(b)[2], want[layer])
    pool = clear_slot(pool, 2)
    for g in GROUPS:
        a, bs = pool.group(1, g)
        assert not np.asarray(a)[2].any() and not any(np.asarray(b)[2].any() for b in bs)
        np.testing.assert_array_equal(np.asarray(a)[0], w4[g][0][1])


def test_write_donates_the_old_buffers(model_config, adapter_dirs):
    pool = make_pool(model_config)
    w = parse(adapter_dirs["r4"], model_config).pool_weights(model_config, R, np.float32)
    new = write_slot(pool, 1, w)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(pool))
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(new))
    cleared = clear_slot(new, 1)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(new))
    assert not np.asarray(cleared.a[0][0]).any()


def test_one_compile_for_every_slot(model_config, adapter_dirs):
    pool = make_pool(model_config, num_slots=7)
    w = parse(adapter_dirs["r8_rslora"], model_config).pool_weights(model_config, R, np.float32)
    shardings = memory_pool._part_shardings(pool, 0)
    # Pools of other slot counts (other tests) share the updater, each shape compiled once.
    write, clear = memory_pool.updater("write", R, shardings), memory_pool.updater("clear", R, shardings)
    before = write._cache_size(), clear._cache_size()
    for slot in range(7):
        pool = write_slot(pool, slot, w)
    assert write._cache_size() - before[0] <= 1
    for slot in range(7):
        pool = clear_slot(pool, slot)
    assert clear._cache_size() - before[1] <= 1


def test_pool_is_a_pytree_usable_in_jit(model_config):
    pool = make_pool(model_config, dtype="bfloat16")
    leaves, treedef = jax.tree_util.tree_flatten(pool)
    assert len(leaves) == 4 + 3 + 1 + 2 + 1 and all(x.dtype == jnp.bfloat16 for x in leaves)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert dataclasses.replace(rebuilt).num_slots == 3 and rebuilt.max_lora_rank == R
    total = jax.jit(lambda p, layer: p.group(layer, "gate_up")[0].sum())(pool, 1)
    assert float(total) == 0.0


def test_bad_slot_and_shapes_are_refused(model_config, adapter_dirs):
    pool = make_pool(model_config)
    w = parse(adapter_dirs["r4"], model_config).pool_weights(model_config, R, np.float32)
    with pytest.raises(ValueError, match=r"slot=3 outside \[0, 3\)"):
        write_slot(pool, 3, w)
    with pytest.raises(ValueError, match="slot=-1"):
        clear_slot(pool, -1)
    bad = parse(adapter_dirs["r4"], model_config).pool_weights(model_config, 2 * R, np.float32)
    with pytest.raises(ValueError, match="group 'qkv'"):
        write_slot(pool, 0, bad)
    bad = {g: (a[:, :-1], bs) for g, (a, bs) in w.items()}
    with pytest.raises(ValueError, match="group 'qkv'"):
        write_slot(pool, 0, bad)
    with pytest.raises(ValueError, match="num_slots=0"):
        LoRAMemoryPool.create(model_config, make_mesh(1, jax.devices()[:1]), num_slots=0, max_lora_rank=R,
                              dtype="float32")
