"""Paged KV layouts for tests that drive the model directly: each sequence ("row") owns
enough blocks for `max_seq_len` tokens, scattered in a random order over the cache, so
every test of the model also exercises block tables that are not contiguous."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lora_runtime.model.kv_cache import AttentionMetadata, KVCache


class RowPages:
    """`rows` sequences of up to `max_seq_len` tokens each, in shuffled blocks of `block_size`."""

    def __init__(self, rows: int, max_seq_len: int, block_size: int = 4, seed: int = 0):
        self.block_size = block_size
        per_row = -(-max_seq_len // block_size)
        order = np.random.default_rng(seed).permutation(rows * per_row) + 1  # block 0: the null block
        self.tables = order.reshape(rows, per_row).astype(np.int32)
        self.num_blocks = rows * per_row + 1

    def cache(self, config, mesh) -> KVCache:
        return KVCache.create(config, self.num_blocks, self.block_size, mesh)

    def slots(self, rows, positions) -> np.ndarray:
        """Each token's cache slot; a row of -1 writes nowhere."""
        rows, positions = np.asarray(rows), np.asarray(positions)
        bs = self.block_size
        safe = np.maximum(rows, 0)
        slot = self.tables[safe, positions // bs] * bs + positions % bs
        return np.where(rows >= 0, slot, self.num_blocks * bs).astype(np.int32)

    def prefill(self, rows, positions) -> AttentionMetadata:
        """Fresh sequences packed back to back; `rows` (-1 = padding) also tells them apart."""
        return AttentionMetadata(slot_mapping=jnp.asarray(self.slots(rows, positions)),
                                 token_seq=jnp.asarray(rows, jnp.int32), mode="prefill")

    def paged(self, rows, positions, groups: int, *, platform: str = "xla", interpret: bool = False
              ) -> AttentionMetadata:
        """`groups` groups of equal size over the tokens; a group's row is its first token's
        (-1: idle, reads the null block)."""
        rows = np.asarray(rows)
        first = rows.reshape(groups, -1)[:, 0]
        tables = np.where(first[:, None] >= 0, self.tables[np.maximum(first, 0)], 0).astype(np.int32)
        return AttentionMetadata(slot_mapping=jnp.asarray(self.slots(rows, positions)),
                                 block_tables=jnp.asarray(tables), mode="paged", platform=platform,
                                 interpret=interpret)

    def decode(self, rows, positions, **kw) -> AttentionMetadata:
        """One token per group (row -1: idle)."""
        return self.paged(rows, positions, len(np.asarray(rows)), **kw)
