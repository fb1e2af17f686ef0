"""A step's small host inputs are sent to the device only when they change: the kept device
copies are what the programs were compiled for (nothing compiles again), a changed leaf is
sent and seen, and a decode step re-sends only what moved (tokens, positions, cache slots,
the sampler's step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from lora_runtime.engine import compile_events
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.device_inputs import MAX_KEPT_BYTES, DeviceInputs
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from tests.helpers.checkpoints import save_tiny_llama


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


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=0)
    eng = Engine.from_pretrained(str(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))), cfg).start()
    yield eng
    eng.shutdown()


def test_a_decode_step_resends_only_what_moved(engine, monkeypatch):
    """Within a batch that keeps its sequences, a decode step sends its tokens, positions and
    cache slots, the sampler's step and sometimes a block table; the sampling parameters,
    the rows and the rest come from the device copies."""
    dispatch = engine.runner.dispatch_decode
    per_step = []

    def counted(inputs, pool, host_work=None):
        before = (engine.runner.inputs.sent, engine.runner.inputs.reused)
        pending = dispatch(inputs, pool, host_work)
        per_step.append((engine.runner.inputs.sent - before[0], engine.runner.inputs.reused - before[1]))
        return pending

    monkeypatch.setattr(engine.runner, "dispatch_decode", counted)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.model_config.vocab_size, size=12).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    want = engine.generate_batch(prompts, params)
    monkeypatch.undo()
    assert len(per_step) >= 8
    steady = per_step[1:]
    assert all(sent <= 5 for sent, _ in steady), per_step
    assert all(reused >= 14 for _, reused in steady), per_step  # of 19 small leaves a step
    # The outputs are those of a run whose every input went to the device afresh.
    engine.runner.inputs = DeviceInputs(engine.runner.mesh)
    again = engine.generate_batch(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
