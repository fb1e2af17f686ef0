"""A pool stacked over layers, with the layer chosen by index, gives each layer's own result.

The kernels read the layer in place (a traced index, also inside lax.scan); each layer of
the stack holds a different adapter set, so reading the wrong layer would show.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.bgmv import bgmv, bgmv_expand, bgmv_shrink
from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.common import stacked_pool
from kernels.sgmv import sgmv, sgmv_expand, sgmv_shrink
from lora_runtime.lora.batch_info import build_batch_info
from tests.kernels.naive import assert_close, make_inputs, naive_lora

F32, BF16 = jnp.float32, jnp.bfloat16
OUTS = (128, 64, 64)
IN = 256
LAYERS = 3


def block_for(platform, dtype):
    if platform == "gpu":
        return BlockSizes(tm=16, bk=64, bn=64, num_splits=2)
    return BlockSizes(tm=16 if dtype == BF16 else 8, bk=128, bn=64)


def stacked_inputs(num_tokens, num_slots, rank, n, dtype, outs=OUTS):
    """One batch (x, slots, base) and LAYERS different pools, plus the pools stacked.

    Slot ranks are shared by the layers (as in the engine's pool); weights differ."""
    rng = np.random.default_rng(num_tokens)
    ranks = rng.integers(1, rank + 1, size=num_slots)
    slots = rng.integers(-1, num_slots, size=num_tokens)
    per_layer = [make_inputs(num_tokens, num_slots, rank, outs[:n], IN, dtype, seed=100 + layer, slots=slots,
                             ranks=ranks) for layer in range(LAYERS)]
    d = dict(per_layer[0])
    d["a_stack"] = jnp.stack([p["a"] for p in per_layer])
    d["b_stack"] = tuple(jnp.stack([p["b"][i] for p in per_layer]) for i in range(n))
    return d, per_layer


def kw(platform, dtype):
    if platform == "cpu":
        return dict(platform="cpu")
    return dict(platform=platform, interpret=True, block=block_for(platform, dtype))


@pytest.mark.parametrize("platform,dtype", [("cpu", F32), ("gpu", F32), ("tpu", BF16)])
def test_bgmv_reads_the_indexed_layer(platform, dtype):
    d, per_layer = stacked_inputs(20, 4, 8, 3, dtype)
    f = jax.jit(lambda d, layer: bgmv(d["x"], d["a_stack"], d["b_stack"], d["base"], d["slots"], d["scalings"],
                                      d["ranks"], layer=layer, **kw(platform, dtype)))
    for layer in range(LAYERS):
        p = per_layer[layer]
        want = naive_lora(d["x"], p["a"], p["b"], d["base"], d["slots"], d["scalings"])
        for g, w in zip(f(d, jnp.int32(layer)), want):
            assert_close(g, w, dtype)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_halves_and_sgmv_read_the_indexed_layer(platform):
    dtype = BF16 if platform == "tpu" else F32
    d, per_layer = stacked_inputs(33, 4, 16, 2, dtype)
    info = build_batch_info(np.asarray(d["slots"]), np.asarray(d["scalings"]), np.asarray(d["ranks"]))
    seg = (info.sorted_order, info.segment_starts, info.segment_slots)
    k = kw(platform, dtype)
    layer = 2
    p = per_layer[layer]
    want = naive_lora(d["x"], p["a"], p["b"], d["base"], d["slots"], d["scalings"])

    v = bgmv_shrink(d["x"], d["a_stack"], d["slots"], d["scalings"], d["ranks"], n_slices=2, layer=layer, **k)
    got = bgmv_expand(v, d["b_stack"], d["base"], d["slots"], d["scalings"], d["ranks"], layer=layer, **k)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)

    got = sgmv(d["x"], d["a_stack"], d["b_stack"], d["base"], d["slots"], *seg, d["scalings"], d["ranks"],
               layer=layer, **k)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)

    v = sgmv_shrink(d["x"], d["a_stack"], d["slots"], *seg, d["scalings"], d["ranks"], n_slices=2, layer=layer, **k)
    got = sgmv_expand(v, d["b_stack"], d["base"], d["slots"], *seg, d["scalings"], d["ranks"], layer=layer, **k)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)


@pytest.mark.parametrize("platform,single_launch", [("cpu", False), ("gpu", False), ("gpu", True)])
def test_layer_index_from_a_scan(platform, single_launch):
    """A scanned layer loop passes the loop index; every layer applies its own adapters."""
    dtype = F32
    d, per_layer = stacked_inputs(16, 4, 8, 1, dtype, outs=(IN,))
    k = kw(platform, dtype)
    if single_launch:
        k["block"] = BlockSizes(tm=16, bk=64, bn=64, single_launch=True)

    def step(x):
        def body(h, layer):
            y = bgmv(h, d["a_stack"], d["b_stack"], (h,), d["slots"], d["scalings"], d["ranks"], layer=layer,
                     **k)[0]
            return y, None
        return jax.lax.scan(body, x, jnp.arange(LAYERS, dtype=jnp.int32))[0]

    got = jax.jit(step)(d["x"])
    h = np.asarray(d["x"], np.float64)
    for p in per_layer:
        h = naive_lora(h, p["a"], p["b"], (h,), d["slots"], d["scalings"])[0]
    assert_close(got, h, dtype)


def test_stacked_pool_checks():
    a3 = jnp.zeros((4, 16, 32))
    a4 = jnp.zeros((2, 4, 16, 32))
    with pytest.raises(ValueError, match="needs the layer"):
        stacked_pool(a4, None)
    with pytest.raises(ValueError, match="per-layer pool"):
        stacked_pool(a3, 0)
    with pytest.raises(ValueError, match="outside the pool's 2 layers"):
        stacked_pool(a4, 2)
    with pytest.raises(ValueError, match="mix per-layer and stacked"):
        stacked_pool((a3, a4), 0)
    with pytest.raises(ValueError, match="neither per-layer nor stacked"):
        stacked_pool(jnp.zeros((4, 16)), None)
    arr, index = stacked_pool(a3, None)
    assert arr.shape == (1, 4, 16, 32) and index.tolist() == [0]
    arr, index = stacked_pool(a4, 1)
    assert arr is a4 and index.tolist() == [1]
