"""The memory plan: each part computed from shapes equals what is then allocated, the workspace
estimate bounds what XLA's compiled steps use, the KV cache takes the rest of the budget, and a
configuration that does not fit is refused, naming the part, before any weight is read."""

from __future__ import annotations

import dataclasses

import math

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks.common import demo_tokenizer, synthetic_config
from kernels.common import page_head_dim
from lora_runtime.engine.sampling import SamplingBatch
from lora_runtime.engine import build
from lora_runtime.engine.build import assemble_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.memory_plan import (
    MemoryPlanError, adapter_pool_bytes, plan_memory, pool_classes, pool_options, saved_module_bytes, weights_bytes,
    workspace_bytes,
)
from lora_runtime.lora.memory_pool import LoRAMemoryPool
from lora_runtime.model.kv_cache import KVCache, block_bytes
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.sharding import make_mesh, shard_model
from tests.helpers.checkpoints import save_tiny_llama

MODEL = synthetic_config(hidden=256, layers=2, heads=8, kv_heads=2, intermediate=512, vocab=4096)
GIB = 1 << 30


def _device_bytes(arrays) -> int:
    """Bytes of the arrays' shards on the first device."""
    first = jax.devices()[0]
    return sum(s.data.nbytes for a in jax.tree_util.tree_leaves(arrays) for s in a.addressable_shards
               if s.device == first)


@pytest.mark.parametrize("tp", [1, 2])
def test_rank_classes_split_the_padded_pool_bytes(tp):
    """Classes share the bytes of max_loras_per_batch padded slots (equally, or by the given
    shares), each in slots of its own rank; what the plan counts is what gets allocated."""
    mesh = make_mesh(tp)
    config = EngineConfig(max_batch=8, max_loras_per_batch=8, max_lora_rank=64, lora_rank_classes=[8, 16, 64])
    kw = pool_options(config)
    assert kw == dict(outer=True, dora=True, bias=True)  # the defaults: every PEFT adapter served
    classes = pool_classes(MODEL, config, tp)
    assert [r for r, _ in classes] == [8, 16, 64]
    budget = adapter_pool_bytes(MODEL, tp, 8, 64, **kw)
    per_class = [adapter_pool_bytes(MODEL, tp, n, r, **kw) for r, n in classes]
    one_slot = [adapter_pool_bytes(MODEL, tp, 1, r, **kw) for r, _ in classes]
    for got, slot in zip(per_class, one_slot):
        assert budget / 3 - slot < got <= budget / 3  # each class its third, in whole slots
    assert classes[0][1] > 3 * classes[2][1]  # many more narrow slots than wide ones
    used = adapter_pool_bytes(MODEL, tp, 0, 0, classes=classes, **kw)
    assert used == sum(per_class) <= budget
    pool = LoRAMemoryPool.create(MODEL, mesh, classes=classes, dtype=MODEL.dtype, **kw)
    assert _device_bytes(pool) == used and pool.num_slots == sum(n for _, n in classes)
    plan = plan_memory(MODEL, config, mesh, platform="gpu", block_size=16, device_bytes=GIB)
    assert plan.adapter_pool_bytes == used
    shared = pool_classes(MODEL, config.model_copy(update={"lora_rank_classes": {8: 3, 64: 1}}), tp)
    narrow, wide = (adapter_pool_bytes(MODEL, tp, n, r, **kw) for r, n in shared)
    assert 2.5 < narrow / wide <= 3.5
    assert pool_classes(MODEL, config.model_copy(update={"lora_rank_classes": None}), tp) is None


@pytest.mark.parametrize("tp", [1, 2])
def test_saved_module_slots_are_counted_as_allocated(tp):
    """modules_to_save slots (a whole embed_tokens and lm_head each, vocab sharded) are in the
    plan's adapter pool bytes exactly as allocated, and only when one module fits the cap."""
    mesh = make_mesh(tp)
    one = MODEL.vocab_size * MODEL.hidden_size * np.dtype(MODEL.dtype).itemsize
    config = EngineConfig(max_batch=8, max_loras_per_batch=3, max_lora_rank=8, lora_embedding_modules=False,
                          lora_dora=False, lora_bias=False, lora_modules_to_save_max_bytes=one,
                          lora_modules_to_save_slots=2)
    assert saved_module_bytes(MODEL, config, tp) == 2 * 2 * one // tp
    pool = LoRAMemoryPool.create(MODEL, mesh, num_slots=3, max_lora_rank=8, dtype=MODEL.dtype,
                                 saved_modules=("embed_tokens", "lm_head"), saved_slots=2)
    plan = plan_memory(MODEL, config, mesh, platform="gpu", block_size=16, device_bytes=GIB)
    assert plan.adapter_pool_bytes == _device_bytes(pool) == adapter_pool_bytes(MODEL, tp, 3, 8) + 4 * one // tp
    small = config.model_copy(update={"lora_modules_to_save_max_bytes": one - 1})
    assert saved_module_bytes(MODEL, small, tp) == 0
    assert plan_memory(MODEL, small, mesh, platform="gpu", block_size=16,
                       device_bytes=GIB).adapter_pool_bytes == adapter_pool_bytes(MODEL, tp, 3, 8)


def test_bad_rank_classes_are_refused_naming_the_arg():
    for classes, match in (([8, 16], "widest class must be max_lora_rank=64"), ([8, 8, 64], "repeats a rank"),
                           ({8: 0, 64: 1}, "must be positive"), ([0, 64], "must be positive")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(max_lora_rank=64, lora_rank_classes=classes)


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_and_pool_are_what_gets_allocated(tp):
    mesh = make_mesh(tp)
    model = LlamaModel(MODEL, rngs=nnx.Rngs(0))
    shard_model(model, mesh)
    assert weights_bytes(MODEL, mesh) == _device_bytes(nnx.state(model, nnx.Param))
    pool = LoRAMemoryPool.create(MODEL, mesh, num_slots=3, max_lora_rank=8, dtype=MODEL.dtype)
    assert adapter_pool_bytes(MODEL, tp, 3, 8) == _device_bytes(pool)
    assert adapter_pool_bytes(MODEL, tp, 0, 8) == 0
    # Room for embed/lm_head adapters and DoRA scales is counted as allocated, too.
    full = LoRAMemoryPool.create(MODEL, mesh, num_slots=3, max_lora_rank=8, dtype=MODEL.dtype, outer=True, dora=True)
    assert adapter_pool_bytes(MODEL, tp, 3, 8, outer=True, dora=True) == _device_bytes(full) > _device_bytes(pool)
    if tp > 1:  # a vocabulary the mesh does not divide: embedding A replicated, head row-parallel
        odd = dataclasses.replace(MODEL, vocab_size=MODEL.vocab_size + 1)
        pool = LoRAMemoryPool.create(odd, mesh, num_slots=3, max_lora_rank=8, dtype=odd.dtype, outer=True, dora=True)
        assert pool.parallel("lm_head") == "row"
        assert adapter_pool_bytes(odd, tp, 3, 8, outer=True, dora=True) == _device_bytes(pool)
    # lora_bias shifts: every group but the embedding, with and without DoRA, on a biased model too.
    for config in (MODEL, dataclasses.replace(MODEL, attention_bias=True)):
        for dora in (False, True):
            kw = dict(outer=True, dora=dora, bias=True)
            biased = LoRAMemoryPool.create(config, mesh, num_slots=3, max_lora_rank=8, dtype=config.dtype, **kw)
            assert adapter_pool_bytes(config, tp, 3, 8, **kw) == _device_bytes(biased)
            assert _device_bytes(biased) > adapter_pool_bytes(config, tp, 3, 8, outer=True, dora=dora)


def _temp_bytes(jitted, *args) -> int:
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_the_workspace_estimate_bounds_every_compiled_step():
    """XLA's own memory analysis of the largest packed prefill (blocked attention past 512
    tokens), a one-sequence chunk, decode and prompt log-probabilities stays within the estimate."""
    config = EngineConfig(max_batch=16, max_seq_len=1024, max_loras_per_batch=2, max_lora_rank=16)
    mesh = make_mesh(1)
    model = LlamaModel(MODEL, rngs=nnx.Rngs(0))
    engine = assemble_engine(model, MODEL, demo_tokenizer(), config, mesh)
    runner, t = engine.runner, config.prefill_budget
    pool = engine._pool()
    with jax.set_mesh(mesh):
        prefill = engine._idle_inputs(t, prefill=True, lora=True)
        chunk = engine._idle_inputs(t, prefill=False, groups=1, lora=True)
        decode = engine._idle_inputs(config.max_batch, prefill=False, groups=config.max_batch, lora=True)
        b = config.max_batch
        used = {
            "prefill": _temp_bytes(runner._prefill, *runner._prefill_args("prefill", prefill, pool, compiling=True)),
            "chunk": _temp_bytes(runner._extend, *runner._prefill_args("extend", chunk, pool, compiling=True)),
            "decode": _temp_bytes(runner._decode, *runner._decode_args(decode, pool, compiling=True)),
            "sample": _temp_bytes(runner._sample, *runner._sample_args(
                jax.ShapeDtypeStruct((b, MODEL.vocab_size), np.float32), SamplingBatch.from_rows([None] * b),
                np.full(b, -1, np.int32), None, compiling=True)),
            "prompt_logprobs": _temp_bytes(runner._prompt_logprobs, runner.state,
                                           jax.ShapeDtypeStruct((t, MODEL.hidden_size), np.float32),
                                           np.zeros(t, np.int32)),
        }
    estimate = workspace_bytes(MODEL, config, 1)
    assert max(used.values()) <= estimate, (used, estimate)
    assert estimate < 4 * max(used.values()), (used, estimate)  # an estimate, not a guess
    assert engine.memory_plan.workspace_bytes == estimate


def test_the_cache_takes_what_the_budget_leaves():
    config = EngineConfig(max_batch=8, max_seq_len=512, max_loras_per_batch=4, max_lora_rank=16,
                          kv_cache_memory_fraction=0.5)
    mesh = make_mesh(2)
    plan = plan_memory(MODEL, config, mesh, platform="gpu", block_size=16, device_bytes=GIB)
    parts = plan.weights_bytes + plan.adapter_pool_bytes + plan.staging_bytes + plan.workspace_bytes
    # room for the adapters staged for their writes: MAX_STAGED waiting and one being written
    assert plan.staging_bytes == adapter_pool_bytes(MODEL, 2, 4 + 1, 16, **pool_options(config)) > 0
    per_block = block_bytes(MODEL, 16) // 2
    assert plan.block_bytes == per_block and plan.budget_bytes == GIB // 2
    assert plan.num_blocks == (GIB // 2 - parts) // per_block
    assert plan.kv_cache_bytes == plan.num_blocks * per_block <= GIB // 2 - parts
    assert plan.kv_tokens == (plan.num_blocks - 1) * 16
    line = plan.describe()
    assert "weights" in line and "adapter pool" in line and f"{plan.num_blocks - 1} blocks of 16 tokens" in line
    assert plan.stats()["kv_capacity_tokens"] == plan.kv_tokens
    # On CPU (no memory limit): one max_seq_len row per sequence, or exactly the bytes given.
    cpu = plan_memory(MODEL, config, mesh, platform="cpu", block_size=16, device_bytes=None)
    assert cpu.num_blocks == config.max_batch * math.ceil(512 / 16) + 1 and cpu.budget_bytes is None
    given = plan_memory(MODEL, config.model_copy(update={"kv_cache_bytes": 100 * per_block}), mesh,
                        platform="cpu", block_size=16, device_bytes=None)
    assert given.num_blocks == 100


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_adapter_memory_fraction_sizes_the_slots_from_the_budget(platform):
    """With adapter_memory_fraction the pool takes as many max_lora_rank slots as that share of
    the budget holds (as the platform lays them out), never fewer than max_loras_per_batch, and
    the KV cache gets what is left; without a memory limit (CPU) max_loras_per_batch stands."""
    mesh = make_mesh(2)
    fixed = EngineConfig(max_batch=8, max_seq_len=512, max_loras_per_batch=4, max_lora_rank=16,
                         kv_cache_memory_fraction=0.5)
    sized = fixed.model_copy(update={"adapter_memory_fraction": 0.2})
    def pool(n: int) -> int:
        return adapter_pool_bytes(MODEL, 2, n, 16, **pool_options(fixed), platform=platform)

    plan = plan_memory(MODEL, sized, mesh, platform=platform, block_size=16, device_bytes=GIB)
    share = 0.2 * plan.budget_bytes
    n = plan.adapter_slots
    assert n > 4 and pool(n) <= share < pool(n + 1)  # the most slots the share holds
    assert plan.adapter_pool_bytes == pool(n)
    one = pool(1)
    if platform == "tpu":  # one slot's f32 terms fill a whole tile: slots in number cost less each
        assert n * one > share
    assert f"({plan.adapter_slots} slots)" in plan.describe()
    base = plan_memory(MODEL, fixed, mesh, platform=platform, block_size=16, device_bytes=GIB)
    assert base.adapter_slots == 4
    # The extra slots' bytes come out of the KV cache (the staged adapters take the same room).
    assert plan.staging_bytes == base.staging_bytes
    freed = plan.adapter_pool_bytes - base.adapter_pool_bytes
    assert abs(plan.kv_cache_bytes - (base.kv_cache_bytes - freed)) < plan.block_bytes  # both in whole blocks
    # A share too small for max_loras_per_batch slots keeps them; no memory limit: max_loras_per_batch.
    tiny = fixed.model_copy(update={"adapter_memory_fraction": one / GIB})
    assert plan_memory(MODEL, tiny, mesh, platform=platform, block_size=16, device_bytes=GIB).adapter_slots == 4
    assert plan_memory(MODEL, sized, mesh, platform="cpu", block_size=16, device_bytes=None).adapter_slots == 4
    # Rank classes split the sized pool's bytes as they split max_loras_per_batch slots' bytes.
    classes = sized.model_copy(update={"lora_rank_classes": [8, 16]})
    split = plan_memory(MODEL, classes, mesh, platform=platform, block_size=16, device_bytes=GIB)
    assert split.adapter_slots == plan.adapter_slots
    assert plan.adapter_pool_bytes - 2 * one < split.adapter_pool_bytes <= plan.adapter_pool_bytes


def test_adapter_memory_fraction_needs_adapters_on():
    with pytest.raises(ValueError, match="adapter_memory_fraction=0.1 sizes the adapter slots, but "
                                         "max_loras_per_batch=0 turns adapters off"):
        EngineConfig(max_loras_per_batch=0, adapter_memory_fraction=0.1)
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="adapter_memory_fraction"):
            EngineConfig(adapter_memory_fraction=bad)


def test_on_tpu_a_page_counts_its_tiled_bytes():
    """A TPU stores a page [bs, head_dim] in (sublane, 128-lane) tiles: head_dim 32 takes 4x its
    bytes. The plan sizes the cache by what the chip allocates; counting the logical bytes, a
    head_dim-32 model's cache alone asked the chip for 4x its memory."""
    import jax.numpy as jnp

    config = EngineConfig(max_batch=8, max_seq_len=512, max_loras_per_batch=0, kv_cache_memory_fraction=0.5)
    mesh = make_mesh(1)
    tpu = plan_memory(MODEL, config, mesh, platform="tpu", block_size=128, device_bytes=GIB)
    gpu = plan_memory(MODEL, config, mesh, platform="gpu", block_size=128, device_bytes=GIB)
    assert MODEL.head_dim == 32
    assert tpu.block_bytes == 4 * gpu.block_bytes == 4 * block_bytes(MODEL, 128)
    # Pages 4x the bytes, and a workspace that reads them as wide: under a quarter of the blocks.
    assert tpu.num_blocks < gpu.num_blocks // 4 and tpu.workspace_bytes > gpu.workspace_bytes
    assert tpu.kv_cache_bytes <= GIB // 2 - tpu.weights_bytes - tpu.workspace_bytes
    # The cache a TPU engine makes pads its heads to those tiles: it takes what the plan counted.
    padded = KVCache.create(MODEL, 2, 128, mesh, head_dim=page_head_dim(MODEL.head_dim, "tpu"))
    assert padded.k.shape[-1] == 128 and padded.bytes_per_block == tpu.block_bytes
    wide = synthetic_config(hidden=1024, layers=2, heads=8, kv_heads=2, intermediate=512, vocab=4096)
    assert wide.head_dim == 128 and block_bytes(wide, 128, platform="tpu") == block_bytes(wide, 128)
    # A block under a whole sublane tile takes the tile's rows: 8 of 32 bits, 16 of bfloat16.
    assert block_bytes(wide, 4, platform="tpu") == block_bytes(wide, 8)
    assert block_bytes(wide, 8, jnp.bfloat16, platform="tpu") == block_bytes(wide, 16, jnp.bfloat16)


def test_on_tpu_small_ranks_count_whole_sublane_tiles():
    """A TPU stores a rank-8 bf16 B block [8, out] in 16-row tiles: the plan counts the adapter
    pool (and staged adapters) as laid out there, so the cache does not take their difference."""
    from kernels.common import stored_elements

    assert stored_elements((4, 8, 4096), "bfloat16", "tpu") == 4 * 16 * 4096
    assert stored_elements((4, 8, 4096), "float32", "tpu") == 4 * 8 * 4096  # a whole f32 tile already
    assert [page_head_dim(d, "tpu") for d in (32, 64, 128, 200)] == [128, 128, 128, 256]
    assert page_head_dim(64, "gpu") == page_head_dim(64, "cpu") == page_head_dim(64, None) == 64
    assert stored_elements((3, 100), "float32", "tpu") == 8 * 128 and stored_elements((3, 100), "float32", None) == 300
    bf16 = synthetic_config(hidden=256, layers=2, heads=8, kv_heads=2, intermediate=512, vocab=4096, dtype="bfloat16")
    config = EngineConfig(max_batch=8, max_seq_len=512, max_loras_per_batch=4, max_lora_rank=8)
    mesh = make_mesh(1)
    tpu = plan_memory(bf16, config, mesh, platform="tpu", block_size=128, device_bytes=GIB)
    gpu = plan_memory(bf16, config, mesh, platform="gpu", block_size=128, device_bytes=GIB)
    logical = adapter_pool_bytes(bf16, 1, 4, 8, **pool_options(config))
    assert gpu.adapter_pool_bytes == logical < tpu.adapter_pool_bytes < 2 * logical
    assert tpu.adapter_pool_bytes == adapter_pool_bytes(bf16, 1, 4, 8, **pool_options(config), platform="tpu")
    assert tpu.staging_bytes > gpu.staging_bytes and tpu.weights_bytes >= gpu.weights_bytes
    # Plain A and B of rank 16 in bf16 are whole tiles when every projection is a multiple of 128
    # wide (here k and v are 4 x 32); the per-slot f32 DoRA scales, [layers, 4 slots, out], fill
    # 8-row tiles.
    wide = synthetic_config(hidden=256, layers=2, heads=8, kv_heads=4, intermediate=512, vocab=4096, dtype="bfloat16")
    assert adapter_pool_bytes(wide, 1, 4, 16, platform="tpu") == adapter_pool_bytes(wide, 1, 4, 16)
    assert adapter_pool_bytes(wide, 1, 4, 16, dora=True, platform="tpu") > adapter_pool_bytes(wide, 1, 4, 16, dora=True)


def test_a_config_that_does_not_fit_is_refused_naming_the_part():
    mesh = make_mesh(1)
    big_pool = EngineConfig(max_batch=8, max_seq_len=512, max_loras_per_batch=8, max_lora_rank=1024)
    pool = adapter_pool_bytes(MODEL, 1, 8, 1024)
    with pytest.raises(MemoryPlanError, match=r"short by .* the largest part is the adapter pool"):
        plan_memory(MODEL, big_pool, mesh, platform="gpu", block_size=16, device_bytes=int(pool * 1.05))
    small = EngineConfig(max_batch=8, max_seq_len=512, max_loras_per_batch=0, kv_cache_bytes=1000)
    with pytest.raises(MemoryPlanError, match="one max_seq_len=512 sequence needs 32"):
        plan_memory(MODEL, small, mesh, platform="cpu", block_size=16, device_bytes=None)
    too_much = small.model_copy(update={"kv_cache_bytes": GIB})
    with pytest.raises(MemoryPlanError, match="exceeds 0.9 x"):
        plan_memory(MODEL, too_much, mesh, platform="gpu", block_size=16, device_bytes=GIB)


def test_a_refused_replica_reads_no_weights(tmp_path, monkeypatch):
    path = save_tiny_llama(tmp_path / "tiny")
    loaded = []
    monkeypatch.setattr(build, "load_model", lambda *a, **k: loaded.append(a) or pytest.fail("weights read"))
    config = EngineConfig(max_batch=2, max_seq_len=64, max_loras_per_batch=0, kv_cache_bytes=64)
    with pytest.raises(MemoryPlanError, match="kv_cache_bytes=64 holds 0 blocks"):
        Engine.from_pretrained(str(path), config)
    assert loaded == []
