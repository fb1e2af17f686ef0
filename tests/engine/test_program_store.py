"""Step programs stored as exports and compiled from them on the next start (ProgramStore)."""

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from lora_runtime.engine.program_store import ProgramStore, exports_available

pytestmark = pytest.mark.skipif(not exports_available(), reason="jax.export serialization needs flatbuffers")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: jax.Array
    scale: jax.Array
    mode: str = dataclasses.field(default="add", metadata=dict(static=True))


traces = []


def _step(state, cache, batch):
    traces.append(batch.mode)  # runs only while JAX traces the function
    y = state["w"][batch.tokens] * batch.scale[:, None]
    y = y + 1 if batch.mode == "add" else y - 1
    return y.sum(axis=0), {"k": cache["k"].at[batch.tokens].add(y)}


step = jax.jit(_step, donate_argnums=(1,))


def _args(n: int = 4, mode: str = "add"):
    state = {"w": jnp.arange(32.0).reshape(8, 4)}
    cache = {"k": jnp.zeros((8, 4))}
    return state, cache, Batch(np.arange(n, dtype=np.int32) % 8, np.linspace(1, 2, n).astype(np.float32), mode)


def _reference(n: int = 4, mode: str = "add"):
    return jax.device_get(jax.jit(_step)(*_args(n, mode)))


def _same(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_restart_runs_the_stored_program_without_tracing_the_python(tmp_path):
    first = ProgramStore(str(tmp_path), "model A")
    first.compile("step", step, _args(), donate=(1,))
    assert (first.saved, first.loaded, len(first)) == (1, 0, 1)
    args = _args()
    out = first.call("step", step, args)
    _same(out, _reference())
    assert args[1]["k"].is_deleted()  # the cache is donated, as the jitted step donates it

    traces.clear()
    restarted = ProgramStore(str(tmp_path), "model A")
    restarted.compile("step", step, _args(), donate=(1,))
    assert (restarted.saved, restarted.loaded) == (0, 1)
    args = _args()
    _same(restarted.call("step", step, args), _reference())
    assert args[1]["k"].is_deleted()
    assert traces == []  # neither its compile nor its call ran the Python


def test_another_context_shape_or_static_field_is_not_the_stored_program(tmp_path):
    ProgramStore(str(tmp_path), "model A").compile("step", step, _args(), donate=(1,))
    other = ProgramStore(str(tmp_path), "model B")  # e.g. another model config
    other.compile("step", step, _args(), donate=(1,))
    assert (other.loaded, other.saved) == (0, 1)
    same = ProgramStore(str(tmp_path), "model A")
    same.compile("step", step, _args(mode="sub"), donate=(1,))  # a static field is part of the program
    assert (same.loaded, same.saved) == (0, 1)
    _same(same.call("step", step, _args(mode="sub")), _reference(mode="sub"))
    # Arguments of a shape no program was compiled for run through jit, as without a store.
    traces.clear()
    _same(same.call("step", step, _args(n=6)), _reference(n=6))
    assert traces == ["add"]


def test_a_program_compiled_for_avals_runs_on_arrays_without_tracing(tmp_path):
    """The sampler is compiled for logits it has not seen (a ShapeDtypeStruct) and called
    with the forward's arrays; weights come first, the same object at every call."""
    calls = []

    def scaled(x, state):
        calls.append(1)
        return x * state["s"]

    fn = jax.jit(scaled)
    state = {"s": jnp.float32(3.0)}
    store = ProgramStore(str(tmp_path), "avals")
    store.compile("scaled", fn, (jax.ShapeDtypeStruct((2, 5), jnp.float32), state))
    store.compile("weights_first", jax.jit(lambda s, x: x + s["s"]), (state, jax.ShapeDtypeStruct((4,), jnp.float32)))
    calls.clear()
    for i in range(3):
        x = jnp.full((2, 5), float(i))
        np.testing.assert_array_equal(store.call("scaled", fn, (x, state)), np.full((2, 5), 3.0 * i))
        y = store.call("weights_first", None, (state, jnp.arange(4.0)))  # None: it must be found
        np.testing.assert_array_equal(y, np.arange(4.0) + 3)
    assert calls == []


def test_a_set_of_programs_is_proven_only_with_the_same_programs_and_check(tmp_path):
    def store(*shapes, context="model A"):
        s = ProgramStore(str(tmp_path), context)
        for n in shapes:
            s.compile("step", step, _args(n), donate=(1,))
        return s

    first = store(4, 6)
    assert not first.proven("ran")
    first.prove("ran")
    assert store(6, 4).proven("ran")  # compiled in another order
    assert not store(6, 4).proven("ran twice")  # another check
    assert not store(4).proven("ran") and not store(4, 6, 5).proven("ran")  # fewer, more programs
    assert not store(4, 6, context="model B").proven("ran")
    assert not ProgramStore(str(tmp_path), "model A").proven("ran")  # none compiled
    unstored = ProgramStore(None, "model A")
    unstored.compile("step", step, _args(4), donate=(1,))
    unstored.prove("ran")
    assert not unstored.proven("ran")


def test_a_start_with_a_program_traced_is_never_proven(tmp_path):
    from jax.experimental import io_callback

    fn = jax.jit(lambda x: io_callback(np.asarray, jax.ShapeDtypeStruct((3,), jnp.float32), x) + 1)

    def store():
        s = ProgramStore(str(tmp_path), "callbacks")
        s.compile("step", step, _args(4), donate=(1,))
        s.compile("cb", fn, (np.ones(3, np.float32),))
        return s

    first = store()
    assert first.traced == 1
    first.prove("ran")
    assert not store().proven("ran")


def test_a_torn_file_is_traced_again_and_replaced(tmp_path, caplog):
    ProgramStore(str(tmp_path), "model A").compile("step", step, _args(), donate=(1,))
    [path] = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    with open(path, "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING):
        store = ProgramStore(str(tmp_path), "model A")
        store.compile("step", step, _args(), donate=(1,))
    assert "unusable" in caplog.text and (store.loaded, store.saved) == (0, 1)
    _same(store.call("step", step, _args()), _reference())
    again = ProgramStore(str(tmp_path), "model A")
    again.compile("step", step, _args(), donate=(1,))
    assert again.loaded == 1


def test_a_program_that_cannot_be_exported_is_traced_and_still_compiled_ahead(tmp_path):
    """A host callback (Pallas kernels interpreted on CPU) cannot be serialized."""
    from jax.experimental import io_callback

    def host(x):
        return np.asarray(x) * 2

    fn = jax.jit(lambda x: io_callback(host, jax.ShapeDtypeStruct((3,), jnp.float32), x) + 1)
    store = ProgramStore(str(tmp_path), "callbacks")
    store.compile("cb", fn, (np.ones(3, np.float32),))
    assert (store.saved, len(store)) == (0, 0)
    np.testing.assert_array_equal(store.call("cb", fn, (np.ones(3, np.float32),)), [3, 3, 3])


def test_a_url_directory_goes_through_fsspec():
    import fsspec

    url = "memory://program-store-test"
    try:
        ProgramStore(url, "model A").compile("step", step, _args(), donate=(1,))
        restarted = ProgramStore(url, "model A")
        restarted.compile("step", step, _args(), donate=(1,))
        assert restarted.loaded == 1
        _same(restarted.call("step", step, _args()), _reference())
        assert not restarted.proven("ran")
        restarted.prove("ran")
        again = ProgramStore(url, "model A")
        again.compile("step", step, _args(), donate=(1,))
        assert again.proven("ran")
    finally:
        fsspec.filesystem("memory").rm(url, recursive=True)


def test_no_directory_compiles_through_jit_and_keeps_nothing():
    store = ProgramStore(None, "model A")
    store.compile("step", step, _args(), donate=(1,))
    assert len(store) == 0
    traces.clear()
    _same(store.call("step", step, _args()), _reference())
    assert traces == []  # jit's own cache holds what compile built


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_a_sharded_program_keeps_its_shardings(tmp_path):
    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    sharded = NamedSharding(mesh, PartitionSpec(None, "tensor"))
    fn = jax.jit(lambda w, x: (x @ w) * 2, out_shardings=sharded)

    def args():
        return jax.device_put(jnp.arange(64.0).reshape(8, 8), sharded), np.ones((3, 8), np.float32)

    with jax.set_mesh(mesh):
        ProgramStore(str(tmp_path), "mesh").compile("mm", fn, args())
        store = ProgramStore(str(tmp_path), "mesh")
        store.compile("mm", fn, args())
        assert store.loaded == 1
        out = store.call("mm", fn, args())
        expected = fn(*args())
    assert out.sharding == expected.sharding
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_a_stored_program_is_named_for_its_step(tmp_path):
    """A profile shows the program under its step's name (jit_step), not the export's `call`."""
    store = ProgramStore(str(tmp_path), "model A")
    store.compile("step", step, _args(), donate=(1,))
    (executable, _), = store._programs.values()
    assert "HloModule jit_step" in executable.as_text()
