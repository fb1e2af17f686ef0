"""Kernel and XLA backends against a naive per-token loop, through BaseLoRABackend, on 1 and 4 devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from lora_runtime.lora.backend.kernel import KernelLoRABackend
from lora_runtime.lora.backend.select import BACKENDS, select_backend
from lora_runtime.lora.backend.xla import XlaLoRABackend

GROUPS = {  # name: (in, outs, parallel)
    "qkv": (64, (64, 32, 32), "column"),
    "o": (64, (64,), "row"),
    "gate_up": (64, (128, 128), "column"),
    "down": (128, (64,), "row"),
}
NUM_SLOTS, RANK = 4, 8


def naive(x, a, b, base, slots, scalings):
    """Python loop over tokens: y_i[t] = base_i[t] + s * (x[t] @ A_i[slot]ᵀ) @ B_i[slot]."""
    outs = [np.array(y, np.float64) for y in base]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for i in range(len(b)):
            v = a[slot, i * RANK : (i + 1) * RANK].astype(np.float64) @ x[t].astype(np.float64)
            outs[i][t] += scalings[slot] * (v @ b[i][slot].astype(np.float64))
    return outs


def make_case(group: str, num_tokens: int, seed: int):
    in_f, outs, parallel = GROUPS[group]
    rng = np.random.default_rng(seed)
    n = len(outs)
    ranks = np.array([8, 4, 2, 8], np.int32)
    row_mask = (np.arange(RANK)[None, :] < ranks[:, None]).astype(np.float32)  # zero-padded ranks
    a = rng.normal(size=(NUM_SLOTS, n * RANK, in_f)).astype(np.float32) * np.tile(row_mask, (1, n))[:, :, None]
    b = tuple(rng.normal(size=(NUM_SLOTS, RANK, o)).astype(np.float32) * row_mask[:, :, None] for o in outs)
    x = rng.normal(size=(num_tokens, in_f)).astype(np.float32)
    base = tuple(rng.normal(size=(num_tokens, o)).astype(np.float32) for o in outs)
    slots = rng.integers(-1, NUM_SLOTS, size=num_tokens).astype(np.int32)
    scalings = np.array([0.5, 2.0, 1.0, 4.0], np.float32)
    return x, a, b, base, slots, scalings, ranks, parallel


def mesh_of(tp: int):
    return None if tp == 1 else Mesh(np.array(jax.devices()[:tp]), ("tensor",))


CASES = [  # backend, group, prefill, tp, T
    ("gpu", "qkv", False, 1, 7),
    ("gpu", "o", True, 4, 16),
    ("gpu", "gate_up", True, 4, 9),
    ("gpu", "down", False, 4, 5),
    ("tpu", "qkv", True, 4, 12),
    ("tpu", "down", False, 1, 7),
    ("tpu", "o", False, 4, 3),
    ("tpu", "gate_up", False, 1, 16),
    ("xla", "qkv", False, 4, 7),
    ("xla", "down", True, 4, 11),
    ("xla", "gate_up", True, 1, 5),
]


def make_backend(kind: str, mesh):
    if kind == "xla":
        return XlaLoRABackend(mesh)
    return KernelLoRABackend(mesh, platform=kind, interpret=True)


@pytest.mark.parametrize("kind,group,prefill,tp,num_tokens", CASES)
def test_backend_matches_naive_loop(kind, group, prefill, tp, num_tokens):
    x, a, b, base, slots, scalings, ranks, parallel = make_case(group, num_tokens, seed=num_tokens + tp)
    backend = make_backend(kind, mesh_of(tp))
    info = backend.prepare_lora_batch(slots, scalings, ranks)

    @jax.jit
    def fused(x, a, b, base, info):
        return backend.run_lora(x, a, b, base, info, prefill=prefill, parallel=parallel)

    @jax.jit
    def two_step(x, a, b, base, info):
        v = backend.run_lora_a_gemm(x, a, info, prefill=prefill, parallel=parallel)
        return v, backend.run_lora_b_gemm(v, b, base, info, prefill=prefill, parallel=parallel)

    want = naive(x, a, b, base, slots, scalings)
    got = fused(x, a, b, base, info)
    v, got2 = two_step(x, a, b, base, info)
    for w, g, g2 in zip(want, got, got2):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-3)
        np.testing.assert_allclose(np.asarray(g2), w, rtol=2e-4, atol=2e-3)
    assert np.all(np.asarray(v)[slots < 0] == 0)


@pytest.mark.parametrize("group,tp,num_tokens,prefill", [("qkv", 4, 12, False), ("down", 4, 7, False),
                                                         ("gate_up", 1, 16, False), ("qkv", 4, 150, True),
                                                         ("down", 1, 70, True)])
def test_tpu_through_the_slot_loop_kernels(monkeypatch, group, tp, num_tokens, prefill):
    """The TPU kernels that walk the batch's distinct slots (kernels.bgmv.tpu; a prompt step's
    rows in tiles), chosen by the tuned table, under the backend's tensor-parallel layouts
    (column and row groups)."""
    from kernels.bgmv import tuned_block_sizes
    monkeypatch.setattr(tuned_block_sizes, "TPU_PREFILL_SLOT_LOOP" if prefill else "TPU_DECODE_SLOT_LOOP", 2)
    x, a, b, base, slots, scalings, ranks, parallel = make_case(group, num_tokens, seed=num_tokens * 5 + tp)
    backend = make_backend("tpu", mesh_of(tp))
    info = backend.prepare_lora_batch(slots, scalings, ranks)

    @jax.jit
    def fused(x, a, b, base, info):
        return backend.run_lora(x, a, b, base, info, prefill=prefill, parallel=parallel)

    text = str(jax.make_jaxpr(fused)(x, a, b, base, info))
    assert "lora_bgmv_shrink" in text and "lora_sgmv" not in text  # the slot loop, not the visits
    for w, g in zip(naive(x, a, b, base, slots, scalings), fused(x, a, b, base, info)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-3)


def test_qkv_and_gate_up_entry_points_on_four_devices():
    backend = KernelLoRABackend(mesh_of(4), platform="gpu", interpret=True)
    for group, run in (("qkv", backend.run_qkv_lora), ("gate_up", backend.run_gate_up_lora)):
        x, a, b, base, slots, scalings, ranks, _ = make_case(group, 6, seed=3)
        info = backend.prepare_lora_batch(slots, scalings, ranks)
        got = jax.jit(lambda x, a, b, base, info, run=run: run(x, a, b, base, info, prefill=False))(x, a, b, base, info)
        for w, g in zip(naive(x, a, b, base, slots, scalings), got):
            np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-3)


def test_agrees_with_reference_backend():
    x, a, b, base, slots, scalings, ranks, parallel = make_case("qkv", 9, seed=5)
    ref = select_backend("reference")
    info = ref.prepare_lora_batch(slots, scalings, ranks)
    want = ref.run_lora(x, a, b, base, info, prefill=False, parallel=parallel)
    got = select_backend("xla").run_lora(x, a, b, base, info, prefill=False, parallel=parallel)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-3)


def test_bf16_pool_casts_activations():
    x, a, b, base, slots, scalings, ranks, parallel = make_case("o", 5, seed=9)
    backend = KernelLoRABackend(None, platform="gpu", interpret=True)
    info = backend.prepare_lora_batch(slots, scalings, ranks)
    a16, b16 = jnp.asarray(a, jnp.bfloat16), tuple(jnp.asarray(t, jnp.bfloat16) for t in b)
    got = backend.run_lora(x, a16, b16, base, info, prefill=False, parallel=parallel)
    want = naive(x, np.asarray(a16, np.float32), [np.asarray(t, np.float32) for t in b16], base, slots, scalings)
    np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=2e-2, atol=0.3)


def test_select_backend_names():
    assert select_backend("auto").name == "xla"  # this test machine is a CPU
    assert select_backend("xla").name == "xla"
    assert select_backend("pallas").name == "pallas"
    assert select_backend("reference").name == "reference"
    assert set(BACKENDS) == {"auto", "reference", "xla", "pallas"}
    with pytest.raises(ValueError, match="'cuda' is not one of"):
        select_backend("cuda")


def test_bad_parallel_and_platform_named():
    x, a, b, base, slots, scalings, ranks, _ = make_case("o", 3, seed=1)
    backend = XlaLoRABackend()
    info = backend.prepare_lora_batch(slots, scalings, ranks)
    with pytest.raises(ValueError, match="parallel='diagonal'"):
        backend.run_lora(x, a, b, base, info, prefill=False, parallel="diagonal")
    with pytest.raises(ValueError, match="platform='npu'"):
        KernelLoRABackend(platform="npu")
