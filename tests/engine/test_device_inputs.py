"""A step's small host inputs are sent to the device only when they change: the kept device
copies are what the programs were compiled for (nothing compiles again), a changed leaf is
sent and seen (a decode step's own count is in test_overlap.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from lora_runtime.engine import compile_events
from lora_runtime.engine.device_inputs import MAX_KEPT_BYTES, DeviceInputs


def _mesh():
    return Mesh(np.array(jax.devices()[:1]), ("tensor",))


def test_a_leaf_is_sent_once_and_again_only_when_its_bytes_change():
    inputs = DeviceInputs(_mesh())
    slots = np.array([0, 1, 1, -1], np.int32)
    scalings = np.array([0.5, 2.0], np.float32)
    first = inputs.put("step", (slots, scalings, np.int32(3)))
    assert (inputs.sent, inputs.reused) == (3, 0)
    assert all(isinstance(a, jax.Array) and a.sharding == inputs.sharding for a in first)
    again = inputs.put("step", (slots.copy(), scalings, np.int32(3)))
    assert (inputs.sent, inputs.reused) == (3, 3) and all(a is b for a, b in zip(first, again))
    slots[1] = 0  # the caller reuses its array: the kept copy is its own
    assert np.asarray(first[0]).tolist() == [0, 1, 1, -1]
    changed = inputs.put("step", (slots, scalings, np.int32(3)))
    assert (inputs.sent, inputs.reused) == (4, 5)
    assert np.asarray(changed[0]).tolist() == [0, 0, 1, -1] and changed[1] is first[1]
    # Another name keeps copies of its own; a new shape is a new leaf.
    inputs.put("other", (slots, scalings, np.int32(3)))
    assert inputs.sent == 7
    assert inputs.put("step", (np.zeros(5, np.int32), scalings, np.int32(3)))[0].shape == (5,)


def test_large_leaves_and_device_arrays_go_as_they_are():
    inputs = DeviceInputs(_mesh())
    mask = np.zeros(MAX_KEPT_BYTES // 4 + 1, np.int32)
    on_device = jnp.ones(3)
    out = inputs.put("sample", (mask, on_device, None))
    assert out[0] is mask and out[1] is on_device and out[2] is None and inputs.sent == 0
    specs = inputs.specs((mask, np.zeros(4, np.float32)))
    assert specs[0] is mask and specs[1] == jax.ShapeDtypeStruct((4,), np.float32, sharding=inputs.sharding)


def test_a_program_compiled_from_the_specs_runs_on_the_copies_without_compiling():
    inputs = DeviceInputs(_mesh())
    host = (np.arange(6, dtype=np.int32), np.full(6, 0.5, np.float32))
    step = jax.jit(lambda slots, scale: slots * scale)
    step.trace(*inputs.specs(host)).lower().compile()
    before = compile_events.counts()
    for shift in range(3):
        got = step(*inputs.put("step", (host[0] + shift, host[1])))
        assert np.allclose(np.asarray(got), (np.arange(6) + shift) * 0.5)
    assert (compile_events.counts() - before).builds == 0
