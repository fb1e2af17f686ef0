"""modules_to_save copies of embed_tokens and lm_head: parity with PEFT (alone and mixed in one
batch with plain, DoRA and embed/head LoRA adapters, tied and untied heads, 1 and 4 devices),
the byte cap, and the saved-module slots the manager allocates and evicts."""

from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lora_runtime.errors import CapacityError, InvalidAdapterError
from lora_runtime.lora.backend.reference import ReferenceLoRABackend
from lora_runtime.lora.backend.xla import XlaLoRABackend
from lora_runtime.lora.base_weights import BaseWeights
from lora_runtime.lora.hook import PoolLoRAHook
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.lora.sources import SourcePolicy
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from tests.helpers.paged import RowPages
from tests.lora.conftest import ALL
from tests.lora.peft_adapters import make_base_model, make_peft_adapter, peft_logits, read_adapter, write_adapter

TOL = 1e-4
POLICY = SourcePolicy(allowed_roots=None, max_adapter_bytes=1 << 24)
SAVED = {  # name -> make_peft_adapter arguments
    "save_head": dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], seed=21),
    "save_embed": dict(r=8, alpha=16, target_modules=ALL, modules_to_save=["embed_tokens"], seed=22),
    "save_both_dora": dict(r=4, alpha=8, target_modules=["o_proj", "down_proj"], use_dora=True,
                           modules_to_save=["embed_tokens", "lm_head"], seed=23),
}
# (adapter or None, prompt length), in one packed prefill.
REQUESTS = [("save_head", 6), (None, 5), ("r4", 4), ("save_embed", 7), ("embed_head", 5), ("save_both_dora", 6),
            ("dora", 4), ("save_head", 3)]


def module_bytes(config, modules=1) -> int:
    return modules * config.vocab_size * config.hidden_size * np.dtype(config.dtype).itemsize


def manager_for(config, mesh, model, *, saved_slots=3, cap=None, **kw):
    shape = kw.pop("shape", dict(num_slots=8))
    return LoRAManager(config, mesh, **shape, max_lora_rank=16, max_cpu_loras=16, max_cpu_bytes=1 << 26,
                       source_policy=POLICY, dtype=config.dtype, base_weights=BaseWeights(model), outer=True,
                       dora=True, saved_module_bytes=module_bytes(config, 2) if cap is None else cap,
                       saved_slots=saved_slots, **kw)


@pytest.fixture(scope="module")
def saved_dirs(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved_adapters")
    return {name: make_peft_adapter(base_dir, root / name, **spec) for name, spec in SAVED.items()}


def packed_prefill_logits(manager, model, config, mesh, requests, prompts):
    """One packed prefill of `requests` through the pool: f32[tokens, vocab]."""
    tokens, positions, rows, token_slots = [], [], [], []
    for row, ((adapter, _), ids) in enumerate(zip(requests, prompts)):
        slot = -1 if adapter is None else manager.acquire_slot(adapter)
        tokens += ids
        positions += range(len(ids))
        rows += [row] * len(ids)
        token_slots += [slot] * len(ids)
    info = manager.prepare_lora_batch(np.array(token_slots, np.int32))
    backend = ReferenceLoRABackend(mesh)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, pool, tokens, positions, attn, cache, info):
        m = nnx.merge(graphdef, state)
        hook = PoolLoRAHook(backend, pool, info, prefill=True)
        hidden, _ = m(tokens, positions, cache, attn, lora=hook)
        return m.logits(hidden, hook)

    pages = RowPages(len(requests), 16)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return np.asarray(step(state, manager.pool, i32(tokens), i32(positions), pages.prefill(rows, positions),
                           pages.cache(config, mesh), info))


def rel_err(ours, ref) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("tp,classes", [(1, None), (4, None), (4, ((4, 4), (16, 4)))])
def test_mixed_batch_matches_peft(tp, classes, base_dir, saved_dirs, adapter_dirs, extra_adapter_dirs):
    dirs = {**saved_dirs, "r4": adapter_dirs["r4"], "embed_head": extra_adapter_dirs["embed_head"],
            "dora": extra_adapter_dirs["dora"]}
    rng = np.random.default_rng(5)
    mesh = make_mesh(tp, jax.devices()[:tp])
    config, model = load_model(str(base_dir), mesh)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for _, n in REQUESTS]
    shape = dict(num_slots=8) if classes is None else dict(rank_classes=classes)
    manager = manager_for(config, mesh, model, shape=shape)
    try:
        assert manager.pool.layout.saved == ("embed_tokens", "lm_head")
        for name, path in dirs.items():
            manager.register(name, str(path))
        logits = packed_prefill_logits(manager, model, config, mesh, REQUESTS, prompts)
        listed = {e["name"]: e for e in manager.list_adapters()}
        assert listed["save_both_dora"]["modules_to_save"] == ["embed_tokens", "lm_head"]
        assert listed["r4"]["modules_to_save"] == []
        start = 0
        for (adapter, n), ids in zip(REQUESTS, prompts):
            ref = peft_logits(base_dir, None if adapter is None else dirs[adapter], ids)
            err = rel_err(logits[start:start + n], ref)
            assert err < TOL, f"{adapter=} {tp=} {err=}"
            if adapter in SAVED:  # the copy moved the logits well past the tolerance
                assert rel_err(peft_logits(base_dir, None, ids), ref) > 100 * TOL, adapter
            start += n
    finally:
        manager.close()


def test_tied_embeddings_keep_the_copies_apart(tmp_path):
    """With lm_head tied to embed_tokens, PEFT's saved copy of one leaves the other as the base
    model has it: a saved head does not change the embedding, nor a saved embedding the head."""
    base = make_base_model(tmp_path / "tied", tie_word_embeddings=True)
    dirs = {name: make_peft_adapter(base, tmp_path / name, r=4, alpha=8, target_modules=["q_proj"],
                                    modules_to_save=[module], seed=30 + i)
            for i, (name, module) in enumerate((("tied_head", "lm_head"), ("tied_embed", "embed_tokens")))}
    mesh = make_mesh(1, jax.devices()[:1])
    config, model = load_model(str(base), mesh)
    assert config.tie_word_embeddings
    manager = manager_for(config, mesh, model, saved_slots=2)
    requests = [("tied_head", 5), ("tied_embed", 6), (None, 4)]
    prompts = [[5, 9, 17, 3, 40], [7, 8, 60, 2, 11, 30], [4, 4, 90, 12]]
    try:
        for name, path in dirs.items():
            manager.register(name, str(path))
        logits = packed_prefill_logits(manager, model, config, mesh, requests, prompts)
        start = 0
        for (adapter, n), ids in zip(requests, prompts):
            ref = peft_logits(base, None if adapter is None else dirs[adapter], ids)
            assert rel_err(logits[start:start + n], ref) < TOL, adapter
            start += n
    finally:
        manager.close()


def test_decode_rows_read_their_saved_head(base_dir, saved_dirs, adapter_dirs):
    """The head on a subset of the step's tokens (the decode and sampled-row path, `rows`)
    takes each row's own saved copy, on the XLA backend too."""
    mesh = make_mesh(2, jax.devices()[:2])
    config, model = load_model(str(base_dir), mesh)
    manager = manager_for(config, mesh, model, saved_slots=2)
    try:
        for name in ("save_head", "save_both_dora"):
            manager.register(name, str(saved_dirs[name]))
        manager.register("r4", str(adapter_dirs["r4"]))
        a, b, c = (manager.acquire_slot(n) for n in ("save_head", "save_both_dora", "r4"))
        token_slots = np.array([a, -1, b, c, a, b], np.int32)
        rows = np.array([4, 1, 2, 3], np.int32)
        info = manager.prepare_lora_batch(token_slots)
        hidden = np.random.default_rng(1).normal(size=(len(rows), config.hidden_size)).astype(np.float32)
        base_logits = np.asarray(hidden @ np.asarray(model.lm_head.kernel[...]))
        outs = []
        for backend in (XlaLoRABackend(mesh), ReferenceLoRABackend(mesh)):
            @jax.jit
            def head(pool, info, hidden, logits, backend=backend):
                return PoolLoRAHook(backend, pool, info, prefill=False).head(hidden, logits, jnp.asarray(rows))

            outs.append(np.asarray(head(manager.pool, info, hidden, base_logits)))
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        heads = {n: read_adapter(saved_dirs[n])[1]["base_model.model.lm_head.weight"]  # [V, H] as PEFT saves it
                 for n in ("save_head", "save_both_dora")}
        want = base_logits.copy()
        want[0] = hidden[0] @ heads["save_head"].T
        want[2] = hidden[2] @ heads["save_both_dora"].T
        # Row 1 has no adapter, row 3's r4 adapter targets no head: the base logits.
        np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-4)
    finally:
        manager.close()


def test_copies_over_the_cap_are_refused_with_their_size(base_dir, saved_dirs):
    mesh = make_mesh(1, jax.devices()[:1])
    config, model = load_model(str(base_dir), mesh)
    one = module_bytes(config)
    for cap, refused in ((0, tuple(SAVED)), (one, ("save_both_dora",))):
        manager = manager_for(config, mesh, model, cap=cap)
        try:
            assert manager.pool.layout.saved == (() if cap == 0 else ("embed_tokens", "lm_head"))
            for name in SAVED:
                if name not in refused:
                    manager.register(name, str(saved_dirs[name]))
                    continue
                size = one * (2 if name == "save_both_dora" else 1)
                with pytest.raises(InvalidAdapterError) as e:
                    manager.register(name, str(saved_dirs[name]))
                assert f"{size} bytes" in str(e.value) and f"lora_modules_to_save_max_bytes={cap}" in str(e.value)
                assert name not in {a["name"] for a in manager.list_adapters()}
        finally:
            manager.close()


def _alias_with_new_copy(src, dst, seed):
    """A copy of an adapter directory whose saved lm_head differs (another content)."""
    config, tensors = read_adapter(src)
    key = "base_model.model.lm_head.weight"
    tensors[key] = tensors[key] + np.random.default_rng(seed).normal(0, 0.05, tensors[key].shape).astype(np.float32)
    return write_adapter(dst, config, tensors)


def test_saved_slots_are_shared_reused_and_evicted(base_dir, saved_dirs, adapter_dirs, tmp_path):
    """One saved-module slot for three saved-head adapters: two names of one content share it,
    a new content evicts the idle holder (whatever its class), a held or pinned holder makes the
    newcomer wait; adapters without copies never need one."""
    mesh = make_mesh(1, jax.devices()[:1])
    config, model = load_model(str(base_dir), mesh)
    manager = manager_for(config, mesh, model, saved_slots=1)
    other = _alias_with_new_copy(saved_dirs["save_head"], tmp_path / "other_head", seed=3)
    try:
        manager.register("h1", str(saved_dirs["save_head"]))
        manager.register("h1_alias", str(shutil.copytree(saved_dirs["save_head"], tmp_path / "alias")))
        manager.register("h2", str(other))
        manager.register("r4", str(adapter_dirs["r4"]))
        s1 = manager.acquire_slot("h1")
        assert manager.acquire_slot("h1_alias") == s1 and manager.stats().loads == 1
        assert manager.acquire_slot("r4") != s1  # no copy: no saved-module slot needed
        assert not manager.can_acquire("h2")  # its one saved-module slot is held
        with pytest.raises(CapacityError, match="no modules_to_save slot for adapter 'h2'"):
            manager.acquire_slot("h2")
        assert manager.slot_of("h1") == s1  # the refusal changed nothing
        manager.release_slot("h1")
        manager.release_slot("h1_alias")
        assert manager.can_acquire("h2")
        s2 = manager.acquire_slot("h2")
        assert manager.slot_of("h1") is None and manager.slot_of("r4") is not None
        assert manager.stats().evictions == 1
        manager.release_slot("h2")
        manager.set_pinned("h2", True)
        assert not manager.can_acquire("h1")  # the holder is pinned
        manager.set_pinned("h2", False)
        assert manager.can_acquire("h1") and manager.slot_of("h2") == s2
    finally:
        manager.close()


def test_warm_up_compiles_the_saved_writes_and_the_dora_scales(base_dir, saved_dirs, extra_adapter_dirs):
    from lora_runtime.engine import compile_events

    mesh = make_mesh(1, jax.devices()[:1])
    config, model = load_model(str(base_dir), mesh)
    manager = manager_for(config, mesh, model, saved_slots=2)
    try:
        manager.warm_up()
        for name in ("save_head", "save_embed"):
            manager.register(name, str(saved_dirs[name]))
        manager.register("dora", str(extra_adapter_dirs["dora"]))  # every module, every layer
        before = compile_events.process_counts().builds
        manager.acquire_slot("save_head")
        manager.acquire_slot("save_embed")
        manager.acquire_slot("dora")
        assert compile_events.process_counts().builds == before
    finally:
        manager.close()
