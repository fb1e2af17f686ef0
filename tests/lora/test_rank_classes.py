"""Rank-aware pool: slots in rank classes, each token's adapter read at its own class's width.

The hook over a class pool is checked against a naive per-token loop (every backend, decode
and prefill, 1 and 4 devices) and against the padded pool with the same adapters in the
same slots (DoRA, embedding and head adapters included); the manager's class choice,
spill into wider classes and per-class eviction; the class views of a step's metadata.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.sgmv.validate import dynamic_validate_segments
from lora_runtime.lora.adapter import LoRAAdapter
from lora_runtime.lora.backend.kernel import KernelLoRABackend
from lora_runtime.lora.backend.xla import XlaLoRABackend
from lora_runtime.lora.base_weights import BaseWeights
from lora_runtime.lora.batch_info import SLOT_DORA, SLOT_EMBED, SLOT_HEAD, build_batch_info
from lora_runtime.lora.dora import output_terms
from lora_runtime.lora.hook import PoolLoRAHook
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.lora.memory_pool import LoRAMemoryPool, write_slot
from lora_runtime.lora.sources import SourcePolicy
from lora_runtime.model.lora_hook import GROUPS, GROUP_SLICES
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from tests.kernels.naive import assert_close

CLASSES = ((4, 2), (8, 2), (16, 2))  # slots 0-1 rank 4, 2-3 rank 8, 4-5 rank 16
R = 16


def parse(path, model_config, rank=R):
    return LoRAAdapter.parse(path.name, (path / "adapter_config.json").read_bytes(),
                             (path / "adapter_model.safetensors").read_bytes(), model_config, rank)


def test_class_views_of_a_step(model_config):
    """Each class sees its own tokens with class-local slots and valid segments of them."""
    rng = np.random.default_rng(0)
    pool_slots = sum(n for _, n in CLASSES)
    firsts = np.cumsum([0] + [n for _, n in CLASSES])[:-1].tolist()
    # One program per class and step length: random slots in steps of a few lengths.
    views = [jax.jit(lambda i, f=f, n=n: i.for_class(f, n)) for f, (_, n) in zip(firsts, CLASSES)]
    for trial in range(20):
        slots = rng.integers(-1, pool_slots, size=int(rng.choice([1, 9, 23]))).astype(np.int32)
        info = build_batch_info(slots, np.arange(pool_slots, dtype=np.float32) + 1, np.full(pool_slots, 4, np.int32),
                                slot_flags=np.arange(pool_slots, dtype=np.int32))
        first = 0
        for class_view, (_, n) in zip(views, CLASSES):
            view = class_view(info)
            mine = (slots >= first) & (slots < first + n)
            np.testing.assert_array_equal(np.asarray(view.token_slots), np.where(mine, slots - first, -1))
            np.testing.assert_array_equal(np.asarray(view.slot_scalings), np.arange(first, first + n) + 1.0)
            np.testing.assert_array_equal(np.asarray(view.slot_flags), np.arange(first, first + n))
            dynamic_validate_segments(view.token_slots, view.sorted_order, view.segment_starts, view.segment_slots)
            starts = np.asarray(view.segment_starts)
            assert starts[0] == 0 and starts[-1] == mine.sum(), (trial, slots, starts)
            assert int(view.num_segments) == len(np.unique(slots[mine]))
            first += n
        assert info.for_class(0, pool_slots) is info


@pytest.fixture(scope="module")
def placed(model_config, adapter_dirs):
    """Global slot -> adapter: two in their own class, one rank-4 spilled into the rank-16 class."""
    names = {0: "r4", 2: "r8_rslora", 3: "r8_layer1", 4: "r16_pattern", 5: "r4"}
    return {slot: parse(adapter_dirs[name], model_config) for slot, name in names.items()}


def class_pool(model_config, placed, mesh, *, classes=CLASSES, outer=False, dora=False, base=None, dtype="float32"):
    kw = dict(classes=classes) if classes else dict(num_slots=sum(n for _, n in CLASSES), max_lora_rank=R)
    pool = LoRAMemoryPool.create(model_config, mesh, dtype=dtype, outer=outer, dora=dora, **kw)
    for slot, adapter in placed.items():
        rank = pool.classes[pool.class_for_rank(adapter.rank)].rank
        terms = output_terms(pool, model_config, base, adapter) if dora else None
        pool = write_slot(pool, slot, adapter.pool_weights(model_config, rank, np.float32, outer), terms)
    return pool


def step_info(placed, num_tokens, seed):
    rng = np.random.default_rng(seed)
    total = sum(n for _, n in CLASSES)
    held = np.array(sorted(placed) + [-1])
    slots = rng.choice(held, size=num_tokens).astype(np.int32)
    slots[: len(held)] = held[: num_tokens]  # every placed adapter and no-adapter in the step
    scal = np.zeros(total, np.float32)
    flags = np.zeros(total, np.int32)
    for s, a in placed.items():
        scal[s] = a.scaling
        flags[s] = (SLOT_DORA if a.use_dora else 0) | (SLOT_EMBED if a.outer("embed_tokens") is not None else 0) | (
            SLOT_HEAD if a.outer("lm_head") is not None else 0)
    return build_batch_info(slots, scal, np.full(total, R, np.int32), num_tokens, flags)


def naive_group(placed, model_config, info, group, layer, x, base):
    """y_i[t] = base_i[t] + scaling * (x[t] @ A_i[adapter]ᵀ) @ B_i[adapter], one token at a time."""
    outs = [np.array(y, np.float64) for y in base]
    for t, slot in enumerate(np.asarray(info.token_slots).tolist()):
        if slot < 0:
            continue
        a, bs = placed[slot].pool_weights(model_config, R, np.float32)[group]
        for i, b in enumerate(bs):
            v = a[layer, i * R:(i + 1) * R].astype(np.float64) @ np.asarray(x[t], np.float64)
            outs[i][t] += float(info.slot_scalings[slot]) * (v @ b[layer].astype(np.float64))
    return outs


def group_inputs(model_config, group, num_tokens, seed):
    from lora_runtime.lora.adapter import group_shapes

    fan_in, outs = group_shapes(model_config)[group]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_tokens, fan_in)).astype(np.float32)
    base = tuple(rng.normal(size=(num_tokens, o)).astype(np.float32) for o in outs)
    return x, base


BACKENDS = {
    "xla": lambda mesh: XlaLoRABackend(mesh),
    "gpu": lambda mesh: KernelLoRABackend(mesh, platform="gpu", interpret=True),
    "tpu": lambda mesh: KernelLoRABackend(mesh, platform="tpu", interpret=True),
}


@pytest.mark.parametrize("backend,prefill,tp", [
    ("xla", False, 1), ("xla", True, 1), ("xla", False, 4), ("xla", True, 4),
    ("gpu", False, 1), ("gpu", True, 1), ("tpu", False, 1), ("tpu", True, 4),
])
def test_hook_over_classes_matches_the_naive_loop(model_config, placed, backend, prefill, tp):
    mesh = make_mesh(tp, jax.devices()[:tp])
    pool = class_pool(model_config, placed, mesh)
    info = step_info(placed, 13, seed=tp + prefill)
    hook = PoolLoRAHook(BACKENDS[backend](mesh if tp > 1 else None), pool, info, prefill=prefill)
    layer = 1
    inputs = {group: group_inputs(model_config, group, info.num_tokens, seed=k) for k, group in enumerate(GROUPS)}
    # Every group in one program: one compile per case.
    gots = jax.jit(lambda p, i, xs: {g: PoolLoRAHook(hook.backend, p, i, prefill=prefill)(g, layer, *xs[g])
                                     for g in GROUPS})(pool, info, inputs)
    for group in GROUPS:
        x, base = inputs[group]
        got = gots[group]
        want = naive_group(placed, model_config, info, group, layer, x, base)
        assert len(got) == len(GROUP_SLICES[group])
        for g_, w in zip(got, want):
            assert_close(g_, w, jnp.float32)


def test_classes_equal_the_padded_pool_with_dora_embed_and_head(model_config, base_dir, adapter_dirs,
                                                                 extra_adapter_dirs):
    """The same adapters in the same slots of a class pool and of the padded pool give the same
    projections, embeddings and logits (the padded pool is checked against PEFT elsewhere)."""
    mesh = make_mesh(1, jax.devices()[:1])
    _, model = load_model(str(base_dir), mesh)
    base = BaseWeights(model)
    placed = {0: parse(extra_adapter_dirs["embed_head"], model_config), 1: parse(adapter_dirs["r4"], model_config),
              2: parse(extra_adapter_dirs["dora"], model_config),
              4: parse(extra_adapter_dirs["dora_head"], model_config),
              5: parse(extra_adapter_dirs["embed_head"], model_config)}
    kw = dict(outer=True, dora=True, base=base)
    ranked = class_pool(model_config, placed, mesh, **kw)
    padded = class_pool(model_config, placed, mesh, classes=None, **kw)
    assert ranked.nbytes < padded.nbytes
    backend = XlaLoRABackend()
    for prefill in (False, True):
        info = step_info(placed, 11, seed=3 + prefill)

        def run(pool, info, x, base_outputs, tokens, hidden, logits):
            hook = PoolLoRAHook(backend, pool, info, prefill=prefill)
            ys = {g: hook(g, 1, x[g], base_outputs[g]) for g in GROUPS}
            return ys, hook.embed(tokens, hidden), hook.head(hidden, logits), hook.head(hidden[:3], logits[:3],
                                                                                          jnp.arange(3) * 2)

        rng = np.random.default_rng(prefill)
        inputs = {g: group_inputs(model_config, g, info.num_tokens, seed=i) for i, g in enumerate(GROUPS)}
        args = ({g: v[0] for g, v in inputs.items()}, {g: v[1] for g, v in inputs.items()},
                rng.integers(0, model_config.vocab_size, size=info.num_tokens).astype(np.int32),
                rng.normal(size=(info.num_tokens, model_config.hidden_size)).astype(np.float32),
                rng.normal(size=(info.num_tokens, model_config.vocab_size)).astype(np.float32))
        got = jax.jit(run)(ranked, info, *args)
        want = jax.jit(run)(padded, info, *args)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(g, w, jnp.float32)
        # and the adapters changed something: the comparison is not of two unchanged inputs
        assert not np.allclose(np.asarray(got[2]), args[4])


def make_manager(model_config, classes, **kw):
    policy = SourcePolicy(allowed_roots=None, max_adapter_bytes=1 << 24)
    return LoRAManager(model_config, make_mesh(1, jax.devices()[:1]), rank_classes=classes, max_lora_rank=R,
                       max_cpu_loras=16, max_cpu_bytes=1 << 26, source_policy=policy, dtype="float32", **kw)


def test_manager_takes_the_narrowest_class_then_spills_then_evicts_within_it(model_config, adapter_dirs, tmp_path):
    import shutil

    manager = make_manager(model_config, ((4, 1), (8, 1), (16, 1)))
    try:
        # Three rank-4 adapters of distinct content: one directory's weights under three alphas.
        dirs = []
        for i, alpha in enumerate((8, 12, 20)):
            d = tmp_path / f"r4_{i}"
            shutil.copytree(adapter_dirs["r4"], d)
            cfg = (d / "adapter_config.json").read_text().replace('"lora_alpha": 8', f'"lora_alpha": {alpha}')
            (d / "adapter_config.json").write_text(cfg)
            dirs.append(d)
        for i, d in enumerate(dirs):
            manager.register(f"a{i}", str(d))
        manager.register("r16", str(adapter_dirs["r16_pattern"]))
        assert all(e["slot"] is None for e in manager.list_adapters())
        assert manager.slot_classes() == {4: (0, 1), 8: (0, 1), 16: (0, 1)}
        s0 = manager.acquire_slot("a0")
        s1 = manager.acquire_slot("a1")
        s2 = manager.acquire_slot("a2")
        assert (s0, s1, s2) == (0, 1, 2)  # narrowest class first, then the wider classes' free slots
        listed = {e["name"]: e for e in manager.list_adapters()}
        assert [listed[f"a{i}"]["slot_rank"] for i in range(3)] == [4, 8, 16]
        assert manager.slot_classes() == {4: (1, 1), 8: (1, 1), 16: (1, 1)}
        # Every slot wide enough for rank 16 is held: the rank-16 adapter must wait.
        assert not manager.can_acquire("r16")
        with pytest.raises(Exception, match="1 slots of rank >= 16 are held"):
            manager.acquire_slot("r16")
        manager.release_slot("a0")
        assert not manager.can_acquire("r16")  # a free rank-4 slot does not fit it
        manager.release_slot("a2")
        assert manager.acquire_slot("r16") == 2  # evicts within the only class it fits
        assert manager.stats().evictions == 1
        assert manager.slot_of("a0") == 0  # the rank-4 class kept its adapter
        # A rank-4 adapter whose class has an evictable slot evicts there, not in a wider class.
        manager.release_slot("r16")
        manager.release_slot("a1")
        manager.acquire_slot("a2")
        assert manager.slot_of("a2") == 0 and manager.slot_of("a1") == 1 and manager.slot_of("r16") == 2
    finally:
        manager.close()


def test_manager_warm_up_compiles_every_class_write(model_config, adapter_dirs, tmp_path):
    import shutil

    from lora_runtime.engine import compile_events

    other_r4 = tmp_path / "r4_other"  # rank 4, its own content (another alpha)
    shutil.copytree(adapter_dirs["r4"], other_r4)
    cfg = (other_r4 / "adapter_config.json").read_text().replace('"lora_alpha": 8', '"lora_alpha": 6')
    (other_r4 / "adapter_config.json").write_text(cfg)
    manager = make_manager(model_config, ((4, 1), (16, 2)))
    try:
        manager.warm_up()
        manager.register("r4", str(adapter_dirs["r4"]))
        manager.register("r16", str(adapter_dirs["r16_pattern"]))
        manager.register("r8", str(adapter_dirs["r8_rslora"]))
        manager.register("r4b", str(other_r4))
        manager.register("r8b", str(adapter_dirs["r8_layer1"]))
        before = compile_events.process_counts().builds
        for name in ("r4", "r16", "r8"):  # rank 4 in its class, 16 and 8 (padded to 16) in the wide one
            manager.acquire_slot(name)
        assert [manager.slot_of(n) for n in ("r4", "r16", "r8")] == [0, 1, 2]
        manager.release_slot("r16")
        manager.acquire_slot("r8b")  # evicts r16 within the wide class
        assert manager.slot_of("r8b") == 1 and manager.slot_of("r16") is None
        manager.release_slot("r8")
        manager.acquire_slot("r4b")  # its class is held: a rank-4 layout written into a rank-16 slot
        assert manager.slot_of("r4b") == 2 and manager.slot_of("r4") == 0
        assert compile_events.process_counts().builds == before
    finally:
        manager.close()


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=1, num_heads=32,
                 num_kv_heads=8, head_dim=128, dtype="bfloat16")
REAL_CLASSES = ((8, 16), (16, 8), (32, 4), (64, 2))


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@pytest.mark.parametrize("platform,prefill,tp", [("tpu", False, 1), ("tpu", True, 1), ("tpu", False, 4),
                                                 ("gpu", False, 1), ("gpu", True, 2)])
def test_class_pool_step_lowers_at_llama3_8b_shapes(model_config, platform, prefill, tp):
    """Every projection group of a rank-class pool (ranks 8..64) through the Pallas kernels lowers
    for TPU (Mosaic) and GPU (Triton) at Llama-3-8B widths, divided as TP `tp` shards them."""
    import dataclasses

    from kernels.common import gpu_lowering_target
    from lora_runtime.lora.adapter import group_shapes

    cfg = dataclasses.replace(model_config, **LLAMA3_8B)
    # Per-device shapes: column groups split their outputs, row groups their inputs (what the
    # shard_map body of a TP replica runs).
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                                intermediate_size=cfg.intermediate_size // tp)
    pool = abstract(jax.eval_shape(lambda: LoRAMemoryPool.create(local, make_mesh(1, jax.devices()[:1]),
                                                                 classes=REAL_CLASSES, dtype="bfloat16")))
    slots = sum(n for _, n in REAL_CLASSES)
    tokens = 512 if prefill else 64
    info = abstract(build_batch_info(np.zeros(tokens, np.int32), np.ones(slots, np.float32),
                                     np.full(slots, 64, np.int32), tokens))
    shapes = group_shapes(local)
    xs = {g: jax.ShapeDtypeStruct((tokens, fan_in), jnp.bfloat16) for g, (fan_in, _) in shapes.items()}
    ys = {g: tuple(jax.ShapeDtypeStruct((tokens, o), jnp.bfloat16) for o in outs) for g, (_, outs) in shapes.items()}
    backend = KernelLoRABackend(None, platform=platform)

    def step(pool, info, xs, ys):
        hook = PoolLoRAHook(backend, pool, info, prefill=prefill)
        return {g: hook(g, 0, xs[g], ys[g]) for g in GROUPS}

    traced = jax.jit(step).trace(pool, info, xs, ys)
    if platform == "gpu":
        with gpu_lowering_target():
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
        kernel = "__gpu$xla.gpu.triton"
    else:
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
        kernel = "tpu_custom_call"
    # One kernel call (or more) per class and group: every class is read at its own width.
    assert text.count(kernel) >= len(REAL_CLASSES) * len(GROUPS), text.count(kernel)
