"""The reference backend against hand-worked cases and a per-token loop, on 1 and 4 devices; the pool hook."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from lora_runtime.lora.adapter import LoRAAdapter, group_shapes
from lora_runtime.lora.backend.reference import ReferenceLoRABackend
from lora_runtime.lora.batch_info import build_batch_info
from lora_runtime.lora.hook import PoolLoRAHook
from lora_runtime.lora.memory_pool import LoRAMemoryPool, write_slot
from lora_runtime.model.lora_hook import GROUPS
from lora_runtime.model.sharding import make_mesh


def test_hand_worked_single_slice():
    # Slot 0: rank 1 (row 1 zero-padded), scaling 2; slot 1: rank 2, scaling 0.5.
    a = jnp.array([[[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]],
                   [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]])  # [S=2, R=2, in=3]
    b = (jnp.array([[[1.0, 2.0], [0.0, 0.0]],
                    [[1.0, 0.0], [0.0, 3.0]]]),)  # [S, R, out=2]
    x = jnp.array([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [1.0, 1.0, 2.0]])  # [T=3, in]
    base = (jnp.array([[10.0, 10.0], [1.0, 1.0], [0.0, 0.0]]),)
    info = build_batch_info(np.array([0, -1, 1]), np.array([2.0, 0.5]), np.array([1, 2]))
    (y,) = ReferenceLoRABackend().run_lora(x, a, b, base, info, prefill=False, parallel="column")
    # t0: x@A0ᵀ = [4, 0] * 2 = [8, 0] -> [8, 16] + base.  t1: no adapter.
    # t2: x@A1ᵀ = [1, 4] * 0.5 = [0.5, 2] -> [0.5, 6].
    np.testing.assert_allclose(np.asarray(y), [[18.0, 26.0], [1.0, 1.0], [0.5, 6.0]])


def loop_reference(x, a, b, base, slots, scalings):
    """y_i[t] = base_i[t] + scale * (x[t] @ A[s]ᵀ)[i*R:(i+1)*R] @ B_i[s], token by token."""
    outs = [np.array(o, np.float64) for o in base]
    R = b[0].shape[1]
    for t, s in enumerate(slots):
        if s < 0:
            continue
        v = (a[s] @ x[t]) * scalings[s]
        for i, b_i in enumerate(b):
            outs[i][t] += v[i * R:(i + 1) * R] @ b_i[s]
    return outs


def random_case(rng, S, R, fan_in, outs, ranks, T):
    n = len(outs)
    a = np.zeros((S, n * R, fan_in), np.float32)
    b = [np.zeros((S, R, o), np.float32) for o in outs]
    for s, r in enumerate(ranks):
        for i in range(n):
            a[s, i * R:i * R + r] = rng.normal(size=(r, fan_in))
            b[i][s, :r] = rng.normal(size=(r, outs[i]))
    x = rng.normal(size=(T, fan_in)).astype(np.float32)
    base = [rng.normal(size=(T, o)).astype(np.float32) for o in outs]
    slots = rng.integers(-1, S, T).astype(np.int32)
    scalings = rng.uniform(0.5, 2.0, S).astype(np.float32)
    return x, a, b, base, slots, scalings


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("outs,parallel", [((64, 32, 32), "column"), ((128, 128), "column"), ((64,), "row")])
def test_matches_token_loop(tp, outs, parallel):
    rng = np.random.default_rng(len(outs) * 10 + tp)
    S, R, fan_in, T = 4, 8, 128, 13
    x, a, b, base, slots, scalings = random_case(rng, S, R, fan_in, outs, ranks=[8, 2, 4, 1], T=T)
    slots[:2] = -1  # at least two tokens without an adapter
    info = build_batch_info(slots, scalings, np.array([8, 2, 4, 1]))
    mesh = make_mesh(tp, jax.devices()[:tp])
    backend = ReferenceLoRABackend(mesh)
    column = parallel == "column"

    def put(arr, spec):
        return jax.device_put(arr, NamedSharding(mesh, spec))

    x_d = put(x, P(None, None) if column else P(None, "tensor"))
    a_d = put(a, P(None, None, None) if column else P(None, None, "tensor"))
    b_d = tuple(put(bi, P(None, None, "tensor") if column else P(None, None, None)) for bi in b)
    base_d = tuple(put(o, P(None, "tensor") if column else P(None, None)) for o in base)
    @jax.jit
    def run(x, a, b, base, info):
        return backend.run_lora(x, a, b, base, info, prefill=True, parallel=parallel)

    ys = run(x_d, a_d, b_d, base_d, info)
    for y, want in zip(ys, loop_reference(x, a, b, base, slots, scalings)):
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-4)
        if column and tp > 1:
            assert y.sharding.spec == P(None, "tensor")
        else:
            assert y.sharding.is_fully_replicated
    untouched = slots < 0
    np.testing.assert_array_equal(np.asarray(ys[0])[untouched], base[0][untouched])


def test_refuses_unknown_parallel():
    info = build_batch_info(np.array([0]), np.array([1.0]), np.array([1]))
    with pytest.raises(ValueError, match="parallel='diagonal'"):
        ReferenceLoRABackend().run_lora_a_gemm(jnp.ones((1, 4)), jnp.ones((1, 2, 4)), info, prefill=True,
                                               parallel="diagonal")


def test_pool_hook_applies_each_group(model_config, adapter_dirs):
    """The hook reads the right layer and group of the pool and treats o/down as row-parallel."""
    mesh = make_mesh(1, jax.devices()[:1])
    pool = LoRAMemoryPool.create(model_config, mesh, num_slots=2, max_lora_rank=16, dtype="float32")
    path = adapter_dirs["r16_pattern"]
    adapter = LoRAAdapter.parse("p", (path / "adapter_config.json").read_bytes(),
                                (path / "adapter_model.safetensors").read_bytes(), model_config, 16)
    weights = adapter.pool_weights(model_config, 16, np.float32)
    pool = write_slot(pool, 1, weights)
    slots = np.array([1, -1, 1, 0], np.int32)
    info = build_batch_info(slots, np.array([0.0, adapter.scaling], np.float32), np.array([0, 16]))
    rng = np.random.default_rng(0)
    backend = ReferenceLoRABackend(mesh)
    for group, (fan_in, outs) in group_shapes(model_config).items():
        x = rng.normal(size=(4, fan_in)).astype(np.float32)
        base = tuple(rng.normal(size=(4, o)).astype(np.float32) for o in outs)

        @jax.jit
        def apply(pool, x, base, info, group=group):
            return PoolLoRAHook(backend, pool, info, prefill=False)(group, 1, x, base)

        got = apply(pool, x, base, info)
        a, bs = weights[group]
        want = loop_reference(x, a[1][None].repeat(2, 0), [bi[1][None].repeat(2, 0) for bi in bs], base,
                              slots, np.array([0.0, adapter.scaling]))
        for y, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(y), w, rtol=1e-5, atol=1e-4)
        assert not np.allclose(np.asarray(got[0])[0], base[0][0]), group
    with pytest.raises(ValueError, match="group='mlp'"):
        PoolLoRAHook(backend, pool, info, prefill=False)("mlp", 0, jnp.ones((4, 64)), (jnp.ones((4, 64)),))
    assert GROUPS == ("qkv", "o", "gate_up", "down")
