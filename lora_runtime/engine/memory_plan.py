"""The device-memory plan of a replica: weights + adapter pool + staged adapters + step workspace,
the rest KV blocks.

Computed from shapes alone, before anything is allocated, per device (each part divided as
the mesh shards it, and as the device lays it out: on TPU every array's last two dims take
whole (sublane, 128-lane) tiles, so a small rank's B block or a narrow head's KV page takes
more than its elements). On GPU and TPU the budget is `kv_cache_memory_fraction` of the
smallest device's memory limit (JAX's allocator limit, `memory_stats()["bytes_limit"]`);
what weights, pool, staged adapters and workspace leave of it becomes KV blocks. On CPU, which reports no
limit, `kv_cache_bytes` sizes the cache (default: what one row per sequence of
`max_seq_len` tokens would hold). `kv_cache_bytes` overrides the fraction anywhere. A plan
whose cache cannot hold one `max_seq_len` sequence is refused, naming the parts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.common import page_head_dim, stored_elements
from lora_runtime.engine.config import EngineConfig
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.kv_cache import block_bytes
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.sharding import TENSOR_AXIS, param_sharding

GIB = float(1 << 30)
# Workspace estimates below count the largest live buffers of a step; XLA fuses some and
# keeps a few more, so the estimate carries this margin (tests/engine/test_memory_plan.py
# checks it against XLA's own memory analysis of the compiled steps).
WORKSPACE_MARGIN = 1.5
# Sampling keeps a handful of [rows, vocab] f32 arrays live (penalties, top-k/p, log-softmax).
SAMPLING_COPIES = 6
CHUNK_KEYS = 128  # keys per chunk of the XLA paged attention (kernels/paged_attention/xla.py)


class MemoryPlanError(ValueError):
    """The configuration does not fit the device; the message names the parts and the shortfall."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of each part, and the KV blocks they leave."""

    platform: str
    devices: int
    device_bytes: int | None  # the smallest device's memory limit (None on CPU)
    budget_bytes: int | None  # the fraction of it the replica may use
    weights_bytes: int
    adapter_pool_bytes: int
    adapter_slots: int  # max_loras_per_batch, or as many as adapter_memory_fraction holds
    staging_bytes: int  # adapters staged on the devices for their slot writes
    workspace_bytes: int
    kv_cache_bytes: int  # num_blocks * block bytes
    block_size: int
    block_bytes: int  # one block of every layer's K and V, on one device
    num_blocks: int  # including the null block

    @property
    def kv_tokens(self) -> int:
        """Tokens the cache holds (every block but the null block)."""
        return (self.num_blocks - 1) * self.block_size

    def describe(self) -> str:
        """One log line: bytes per part, blocks, tokens that fit."""
        budget = "" if self.budget_bytes is None else f" of {_gib(self.budget_bytes)} budget"
        return (f"memory plan per device ({self.devices} x {self.platform}{budget}): weights "
                f"{_gib(self.weights_bytes)}, adapter pool {_gib(self.adapter_pool_bytes)} "
                f"({self.adapter_slots} slots), staged adapters "
                f"{_gib(self.staging_bytes)}, workspace "
                f"{_gib(self.workspace_bytes)}, KV cache {_gib(self.kv_cache_bytes)} = {self.num_blocks - 1} "
                f"blocks of {self.block_size} tokens ({self.kv_tokens} tokens)")

    def stats(self) -> dict[str, int]:
        """The plan as engine stats (and so as metrics)."""
        return {"memory_weights_bytes": self.weights_bytes, "memory_adapter_pool_bytes": self.adapter_pool_bytes,
                "memory_adapter_staging_bytes": self.staging_bytes,
                "memory_workspace_bytes": self.workspace_bytes, "memory_kv_cache_bytes": self.kv_cache_bytes,
                "kv_capacity_tokens": self.kv_tokens}


def _gib(n: int) -> str:
    """Bytes in the unit that shows them best (GiB down to KiB)."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def weights_bytes(model_config: ModelConfig, mesh: jax.sharding.Mesh, platform: str | None = None) -> int:
    """Bytes of the model's parameters on one device, from their abstract shapes and shardings
    (as `platform` lays them out)."""
    abstract = nnx.eval_shape(lambda: LlamaModel(model_config, rngs=nnx.Rngs(0)))
    total = 0
    for path, value in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        arr = value.get_value()
        shard = param_sharding(path, arr.shape, mesh).shard_shape(arr.shape)
        total += stored_elements(shard, arr.dtype, platform) * jnp.dtype(arr.dtype).itemsize
    return total


def adapter_pool_bytes(model_config: ModelConfig, tp: int, num_slots: int, max_lora_rank: int, *,
                       outer: bool = False, dora: bool = False, bias: bool = False,
                       classes: Sequence[tuple[int, int]] | None = None, platform: str | None = None) -> int:
    """Bytes of the adapter pool on one device (its layout: lora_runtime/lora/memory_pool.py):
    `num_slots` slots of rank `max_lora_rank`, or the rank `classes` ((rank, slots) pairs),
    as `platform` lays them out (stored_elements)."""
    from lora_runtime.lora.memory_pool import TENSOR_AXIS as POOL_AXIS, PoolLayout, aligned, group_dims, row_align_for

    if classes is None:
        classes = ((max_lora_rank, num_slots),) if num_slots else ()
    itemsize = jnp.dtype(model_config.dtype).itemsize
    layout = PoolLayout.of(model_config, tp, outer=outer, dora=dora, bias=bias)

    def per_device(shape, spec, dtype=model_config.dtype) -> int:
        local = [n // tp if i < len(spec) and spec[i] == POOL_AXIS else n for i, n in enumerate(shape)]
        return stored_elements(local, dtype, platform)

    align = row_align_for(platform)
    total = 0
    for rank, slots in classes:
        rows, held = aligned(rank, align), aligned(slots, align)  # as the pool holds them
        for g, shifted in zip(layout.groups, layout.shifted):
            depth, fan_in, outs = group_dims(model_config, g)
            a_spec, b_spec, s_spec = layout.specs(g)
            total += per_device((depth, slots, len(outs) * rows, fan_in), a_spec) * itemsize
            total += sum(per_device((depth, slots, rows, o), b_spec) for o in outs) * itemsize
            terms = int(layout.has_scale(g)) + int(shifted)  # f32 scale and shift where held
            total += terms * sum(per_device((depth, held, o), s_spec, jnp.float32) for o in outs) * 4
    return total


def pool_options(config: EngineConfig) -> dict[str, bool]:
    """What the engine's adapter slots hold beside A and B, as adapter_pool_bytes and the
    pool take it."""
    return dict(outer=config.lora_embedding_modules, dora=config.lora_dora, bias=config.lora_bias)


def saved_module_bytes(model_config: ModelConfig, config: EngineConfig, tp: int) -> int:
    """Bytes on one device of the saved-module slots (modules_to_save copies of embed_tokens
    and lm_head, see memory_pool): none unless one module fits lora_modules_to_save_max_bytes."""
    from lora_runtime.lora.memory_pool import saved_modules_within

    if not config.max_loras_per_batch:
        return 0
    modules = saved_modules_within(model_config, config.lora_modules_to_save_max_bytes, model_config.dtype)
    vocab = model_config.vocab_size // tp if model_config.vocab_size % tp == 0 else model_config.vocab_size
    one = vocab * model_config.hidden_size * jnp.dtype(model_config.dtype).itemsize
    return len(modules) * config.lora_modules_to_save_slots * one


def pool_classes(model_config: ModelConfig, config: EngineConfig, tp: int) -> tuple[tuple[int, int], ...] | None:
    """The (rank, slots) classes of `config.lora_rank_classes`, sized from the bytes of
    `max_loras_per_batch` slots of `max_lora_rank` (so classes never take more memory than
    the padded pool): each class gets its share of those bytes in slots of its own rank.
    None: the padded pool (no classes configured, or LoRA off)."""
    spec = config.rank_class_shares()
    if spec is None or not config.max_loras_per_batch:
        return None
    kw = pool_options(config)
    budget = adapter_pool_bytes(model_config, tp, config.max_loras_per_batch, config.max_lora_rank, **kw)
    total = sum(spec.values())
    out = []
    for rank, share in sorted(spec.items()):
        part = int(budget * share / total)
        out.append((rank, _most(lambda n: adapter_pool_bytes(model_config, tp, n, rank, **kw) <= part, 1)))
    return tuple(out)


def staging_bytes(model_config: ModelConfig, config: EngineConfig, tp: int, platform: str | None = None) -> int:
    """Bytes on one device of the adapters staged for their slot writes: the manager's
    MAX_STAGED waiting and one being written, each a slot of the widest rank (0 with LoRA off)."""
    from lora_runtime.lora.manager import MAX_STAGED

    if not config.max_loras_per_batch:
        return 0
    slots = min(config.max_loras_per_batch, MAX_STAGED) + 1
    return adapter_pool_bytes(model_config, tp, slots, config.max_lora_rank, **pool_options(config),
                              platform=platform)


def workspace_bytes(model_config: ModelConfig, config: EngineConfig, tp: int, platform: str | None = None) -> int:
    """An upper estimate of the temporary bytes of the largest step on one device: packed
    prefill at the full budget, a chunk over the cache, decode, or prompt log-probabilities
    (pages read as `platform` lays them out: page_head_dim)."""
    c, f = model_config, 4
    a = jnp.dtype(c.dtype).itemsize
    hq, hkv, d = c.num_heads // tp, c.num_kv_heads // tp, c.head_dim
    dp = page_head_dim(d, platform)
    vocab = c.vocab_size // tp if c.vocab_size % tp == 0 else c.vocab_size
    rank = config.max_lora_rank if config.max_loras_per_batch else 0

    def layer(tokens: int) -> int:  # one layer's activations and LoRA intermediates
        width = 2 * c.hidden_size + (2 * hq + 2 * hkv) * d + 3 * c.intermediate_size // tp
        return tokens * (width * a + 2 * (c.hidden_size + (hq + hkv) * d) * f + 6 * rank * f)

    def sampling(rows: int) -> int:
        return rows * c.vocab_size * f * SAMPLING_COPIES

    t, rows = config.prefill_budget, config.max_batch
    scores = hq * t * min(t, 512) * f * 3 + hq * t * d * f
    prefill = layer(t) + scores + sampling(rows) + t * c.hidden_size * a
    paged = layer(t) + 3 * hq * t * CHUNK_KEYS * f + 2 * t * CHUNK_KEYS * hkv * dp * a + sampling(1)
    decode = layer(rows) + 3 * hq * rows * CHUNK_KEYS * f + 2 * rows * CHUNK_KEYS * hkv * dp * a + sampling(rows)
    prompt_logprobs = t * vocab * f * 3
    return int(WORKSPACE_MARGIN * max(prefill, paged, decode, prompt_logprobs))


def device_memory_bytes(devices) -> int | None:
    """The smallest memory limit among `devices`, or None if they report none (CPU)."""
    limits = []
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def adapter_slots(model_config: ModelConfig, config: EngineConfig, tp: int, *, platform: str,
                  device_bytes: int | None) -> int:
    """The device adapter slots: max_loras_per_batch, or with adapter_memory_fraction and a known
    memory limit, as many slots of max_lora_rank as that share of the budget holds, if more. The
    pool's bytes are counted as `platform` lays them out, for the whole count (on TPU the f32
    per-output terms of a few slots take a whole tile: one slot alone costs more than its share)."""
    slots = config.max_loras_per_batch
    if config.adapter_memory_fraction is None or device_bytes is None or not slots:
        return slots
    share = int(config.adapter_memory_fraction * config.kv_cache_memory_fraction * device_bytes)
    kw = dict(pool_options(config), platform=platform)

    def fits(n: int) -> bool:
        return adapter_pool_bytes(model_config, tp, n, config.max_lora_rank, **kw) <= share

    return _most(fits, slots)


def _most(fits, least: int) -> int:
    """The largest n >= `least` with fits(n) (fits: true up to some n, false after), or `least`."""
    if not fits(least + 1):
        return least
    lo, hi = least + 1, 2 * (least + 1)  # fits(lo); find a hi that does not
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def with_slots(config: EngineConfig, slots: int) -> EngineConfig:
    """`config` with `slots` device adapter slots (the memory plan's count)."""
    if slots == config.max_loras_per_batch:
        return config
    return config.model_copy(update={"max_loras_per_batch": slots})


def plan_memory(model_config: ModelConfig, config: EngineConfig, mesh: jax.sharding.Mesh, *, platform: str,
                block_size: int, device_bytes: int | None) -> MemoryPlan:
    """Sizes the adapter slots (adapter_slots) and the KV cache; raises MemoryPlanError (before
    anything is allocated) if it cannot fit."""
    tp = mesh.shape.get(TENSOR_AXIS, 1)
    config = with_slots(config, adapter_slots(model_config, config, tp, platform=platform, device_bytes=device_bytes))
    # Bytes as the device lays them out (on TPU, whole tiles: a small rank's B takes more).
    weights = weights_bytes(model_config, mesh, platform)
    pool = adapter_pool_bytes(model_config, tp, config.max_loras_per_batch, config.max_lora_rank,
                              **pool_options(config), classes=pool_classes(model_config, config, tp), platform=platform)
    pool += saved_module_bytes(model_config, config, tp)
    staging = staging_bytes(model_config, config, tp, platform)
    workspace = workspace_bytes(model_config, config, tp, platform)
    per_block = block_bytes(model_config, block_size, platform=platform) // tp  # as the device lays it out
    blocks_per_seq = math.ceil(config.max_seq_len / block_size)
    budget = None
    if config.kv_cache_bytes is not None:
        kv = config.kv_cache_bytes
    elif device_bytes is not None:
        budget = int(config.kv_cache_memory_fraction * device_bytes)
        kv = budget - weights - pool - staging - workspace
    else:  # CPU: as much as one max_seq_len row per sequence would take
        kv = config.max_batch * blocks_per_seq * per_block + per_block
    if device_bytes is not None and config.kv_cache_bytes is not None:
        budget = int(config.kv_cache_memory_fraction * device_bytes)
        over = weights + pool + staging + workspace + kv - budget
        if over > 0:
            raise MemoryPlanError(
                f"kv_cache_bytes={kv} with weights {_gib(weights)}, adapter pool {_gib(pool)}, staged adapters "
                f"{_gib(staging)} and workspace "
                f"{_gib(workspace)} exceeds {config.kv_cache_memory_fraction} x {_gib(device_bytes)} per device "
                f"by {_gib(over)}")
    num_blocks = max(kv // per_block, 0)
    needed = (blocks_per_seq + 1) * per_block
    if num_blocks < blocks_per_seq + 1:
        sized_by = ("adapter_memory_fraction" if config.adapter_memory_fraction is not None
                    and device_bytes is not None else "max_loras_per_batch")
        pool_part = f"adapter pool ({config.max_loras_per_batch} slots: {sized_by}, max_lora_rank)"
        parts = {"weights": weights, pool_part: pool,
                 "staged adapters (max_lora_rank)": staging,
                 "step workspace (max_prefill_tokens, max_batch)": workspace}
        largest = max(parts, key=parts.get)
        if config.kv_cache_bytes is not None or budget is None:
            raise MemoryPlanError(
                f"kv_cache_bytes={kv} holds {num_blocks} blocks of {block_size} tokens; one max_seq_len="
                f"{config.max_seq_len} sequence needs {blocks_per_seq} plus the null block ({needed} bytes)")
        raise MemoryPlanError(
            f"the KV cache gets {_gib(max(kv, 0))} per device ({config.kv_cache_memory_fraction} x "
            f"{_gib(device_bytes)} minus weights {_gib(weights)}, adapter pool {_gib(pool)}, staged adapters "
            f"{_gib(staging)} and workspace "
            f"{_gib(workspace)}), short by {_gib(needed - kv)} of one max_seq_len={config.max_seq_len} "
            f"sequence; the largest part is the {largest} ({_gib(parts[largest])})")
    return MemoryPlan(
        platform=platform, devices=mesh.size, device_bytes=device_bytes, budget_bytes=budget,
        weights_bytes=weights, adapter_pool_bytes=pool, adapter_slots=config.max_loras_per_batch,
        staging_bytes=staging, workspace_bytes=workspace,
        kv_cache_bytes=num_blocks * per_block, block_size=block_size, block_bytes=per_block, num_blocks=num_blocks,
    )
