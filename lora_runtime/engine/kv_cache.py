"""The per-layer key/value cache and the metadata that says where each token's K/V goes.

One cache row holds one running sequence; a token at position p of row r writes its
K/V at ``[r, p]``. The cache shards kv heads over the mesh's tensor axis, like the k/v
projections that produce them, so attention needs no communication.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from lora_runtime.model.config import ModelConfig
from lora_runtime.model.sharding import DEFAULT_RULES

MODES: tuple[str, ...] = ("prefill", "extend", "extend_rows", "decode")


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of each layer's K or V: kv heads over the tensor axis."""
    return DEFAULT_RULES.sharding(mesh, "batch", "seq", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, as arrays a jitted step can donate."""

    k: tuple[jax.Array, ...]  # per layer [rows, max_seq_len, num_kv_heads, head_dim], model dtype
    v: tuple[jax.Array, ...]  # per layer [rows, max_seq_len, num_kv_heads, head_dim], model dtype

    @classmethod
    def create(cls, config: ModelConfig, rows: int, max_seq_len: int, mesh: Mesh) -> KVCache:
        """A zeroed cache of ``rows`` sequences of up to ``max_seq_len`` tokens, kv heads sharded."""
        if rows < 1 or max_seq_len < 1:
            raise ValueError(f"{rows=} and {max_seq_len=} must both be >= 1")
        shape = (rows, max_seq_len, config.num_kv_heads, config.head_dim)
        sharding = kv_cache_sharding(mesh)
        zeros = jax.jit(lambda: jnp.zeros(shape, config.dtype), out_shardings=sharding)
        return cls(
            k=tuple(zeros() for _ in range(config.num_layers)),
            v=tuple(zeros() for _ in range(config.num_layers)),
        )

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take over all layers."""
        _, _, heads, head_dim = self.k[0].shape
        return 2 * len(self.k) * heads * head_dim * self.k[0].dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache (all devices' shards together)."""
        return self.rows * self.max_seq_len * self.bytes_per_token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Which cache row each token of a step belongs to, and whether the step is prefill, extend or decode.

    prefill: tokens are whole fresh sequences packed back to back, positions from 0;
    each attends to earlier tokens of its own row in the same batch.
    extend: a chunk of one sequence whose earlier tokens are already in its row (a cached
    prefix, or earlier chunks of a long prompt), positions from where the row's content ends;
    each token attends to its row of the cache up to its own position.
    extend_rows: like extend for `sequences` (E) sequences at once, C tokens each (sequence
    e's chunk in tokens [e * C, (e + 1) * C), padded), each over its own row.
    decode: token t belongs to row t and attends to cache[t, :positions[t] + 1].
    rows[t] == -1 marks padding (prefill) or an idle row (decode): nothing is written
    and its output is garbage-free but meaningless.
    """

    rows: jax.Array  # i32[T]
    mode: str = dataclasses.field(metadata=dict(static=True))
    sequences: int = dataclasses.field(default=0, metadata=dict(static=True))  # extend_rows: E

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"attention mode={self.mode!r} is not one of {MODES}")
