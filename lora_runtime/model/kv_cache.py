"""The paged key/value cache, and the metadata that says where each token's K/V go and what it reads.

K and V are pages, one array each for every layer: `[num_kv_heads, L * num_blocks,
block_size, D]` (D the head_dim; on TPU padded with zeros to whole 128-lane tiles,
kernels.common.page_head_dim), a block of `block_size` consecutive positions of one
sequence per page, layer l's pages at [l * num_blocks, (l + 1) * num_blocks). A block id (what block
tables and slot mappings hold, 0 .. num_blocks - 1) names the same block in every layer:
layer l reads and writes page l * num_blocks + block (`layer_pages`, `layer_slots`). So
the layers run as one loop over the cache, carried and updated in place, and every
attention formulation reads a layer's pages straight out of the one array, never a
layer sliced (copied) out of it.

A sequence's block table lists its blocks in position order, so position p lives in block
table[p // bs] at offset p % bs; sequences with a common prefix share its blocks. Block 0
is the null block: never handed out, it is what unused table entries point at. The pages
shard kv heads over the mesh's tensor axis, like the k/v projections that produce them,
so attention needs no communication. This layout is what every attention formulation
reads (kernels/paged_attention): tile-aligned [bs, D] pages for the TPU kernel, and JAX's
GPU paged-attention layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from kernels.common import stored_elements
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.sharding import DEFAULT_RULES, zeros_on

MODES: tuple[str, ...] = ("prefill", "paged")
NULL_BLOCK = 0


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of each layer's K or V pages: kv heads over the tensor axis."""
    return DEFAULT_RULES.sharding(mesh, "kv_heads", None, None, "head_dim")


def block_bytes(config: ModelConfig, block_size: int, dtype=None, *, platform: str | None = None) -> int:
    """Bytes one block takes over all layers, K and V, all devices' shards together.

    On "tpu" a page [block_size, head_dim] is stored in (sublane, 128-lane) tiles, so a head_dim
    under a multiple of 128 takes the whole lanes (head_dim 32 takes 4x its bytes) and a block
    size under a multiple of the sublane tile its whole rows (kernels.common.stored_elements)."""
    dtype = jnp.dtype(dtype or config.dtype)
    page = stored_elements((block_size, config.head_dim), dtype, platform)
    return 2 * config.num_layers * config.num_kv_heads * page * dtype.itemsize


@functools.partial(jax.tree_util.register_dataclass, data_fields=("k", "v"), meta_fields=("num_layers",))
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer as pages, arrays a jitted step can donate."""

    k: jax.Array  # [Hkv, L * num_blocks, block_size, D >= head_dim], model dtype; layer l's pages from l * num_blocks
    v: jax.Array  # same
    num_layers: int

    @classmethod
    def create(cls, config: ModelConfig, num_blocks: int, block_size: int, mesh: Mesh,
               head_dim: int | None = None) -> KVCache:
        """A zeroed cache of `num_blocks` blocks (block 0 the null block) in every layer, kv heads sharded.

        `head_dim`: the pages' last dim, the model's head_dim or wider (kernels.common.page_head_dim:
        a TPU cache fills whole lane tiles); the dims past the model's stay zero."""
        head_dim = config.head_dim if head_dim is None else head_dim
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"{num_blocks=} must be >= 2 (block 0 is the null block) and {block_size=} >= 1")
        if head_dim < config.head_dim:
            raise ValueError(f"{head_dim=} is narrower than the model's head_dim {config.head_dim}")
        shape = (config.num_kv_heads, config.num_layers * num_blocks, block_size, head_dim)
        sharding = kv_cache_sharding(mesh)
        return cls(k=zeros_on(shape, config.dtype, sharding), v=zeros_on(shape, config.dtype, sharding),
                   num_layers=config.num_layers)

    @property
    def num_blocks(self) -> int:
        """Blocks of each layer (block ids 0 .. num_blocks - 1)."""
        return self.k.shape[1] // self.num_layers

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def arrays(self) -> tuple[jax.Array, jax.Array]:
        return self.k, self.v

    def layer(self, kv: jax.Array, layer: int) -> jax.Array:  # [Hkv, num_blocks, bs, D]
        """Layer `layer`'s pages of `kv` (self.k or self.v), for reading on the host."""
        n = self.num_blocks
        return kv[:, layer * n:(layer + 1) * n]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, K and V (all devices' shards together)."""
        heads, _, bs, head_dim = self.k.shape
        return 2 * self.num_layers * heads * bs * head_dim * self.k.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def layer_pages(block_ids: jax.Array, layer: jax.Array | int, num_blocks: int) -> jax.Array:
    """The pages of `block_ids` in layer `layer` (an int or a traced scalar)."""
    return block_ids + layer * num_blocks


def layer_slots(slot_mapping: jax.Array, layer: jax.Array | int, num_blocks: int, block_size: int,
                num_layers: int) -> jax.Array:
    """Slots of one layer's pages from a step's slot mapping (block * bs + offset); a slot past
    the blocks (padding) stays past every layer's, so it is still written nowhere."""
    per_layer = num_blocks * block_size
    return jnp.where(slot_mapping < per_layer, slot_mapping + layer * per_layer, num_layers * per_layer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens write their K/V, and what their queries read.

    prefill: whole fresh sequences packed back to back (positions from 0); each token
    attends to earlier tokens of its own sequence (`token_seq`) computed in the same step,
    so nothing is read from the cache.
    paged: the T tokens are Q groups of C = T / Q consecutive positions of one sequence
    each (decode: C = 1, a group per running sequence; a chunk over a cached prefix or
    earlier chunks: C tokens, one group or several); group g's query c sits at position
    positions[g * C] + c and reads its sequence's pages (`block_tables[g]`) up to there.
    Padding tokens write nowhere (`slot_mapping` past the cache) and idle groups read the
    null block: their outputs are finite and meaningless.
    `platform` picks the attention formulation (kernels/paged_attention: xla, tpu, gpu);
    `interpret` runs a kernel in Pallas interpret mode (tests on CPU).
    """

    slot_mapping: jax.Array  # i32[T]: block * block_size + offset; >= num_blocks * block_size: not written
    token_seq: jax.Array | None = None  # i32[T], prefill: the token's sequence in the step, -1 = padding
    block_tables: jax.Array | None = None  # i32[Q, P], paged: each group's blocks in position order
    mode: str = dataclasses.field(default="prefill", metadata=dict(static=True))
    platform: str = dataclasses.field(default="xla", metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"attention mode={self.mode!r} is not one of {MODES}")
        needed = "token_seq" if self.mode == "prefill" else "block_tables"
        if getattr(self, needed) is None:
            raise ValueError(f"attention mode={self.mode!r} needs {needed}")
