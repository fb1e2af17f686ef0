"""The layers as one loop: a step's program does not grow with depth, and the loop updates
the one KV cache array in place instead of copying it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lora_runtime.model.kv_cache import KVCache
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.sharding import make_mesh
from tests.helpers.paged import RowPages
from tests.model.test_llama import CONFIG

PAGES = RowPages(4, 256, block_size=8)  # a cache far larger than a layer's weights


def decode_step(config, scan_layers: bool, extra_blocks: int = 0):
    """(the jitted decode step donating the cache, its arguments) of a random model, over a
    cache of PAGES' blocks plus `extra_blocks` unused ones."""
    model = LlamaModel(config, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, cache, tokens, positions, attn):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens, positions, cache, attn)
        return m.logits(hidden), cache

    positions = [5, 9, 0, 30]
    attn = PAGES.decode([0, 1, 2, 3], positions)
    # The padding slot of PAGES' metadata is past its blocks, so inside a larger cache: write none.
    attn = dataclasses.replace(attn, slot_mapping=jnp.asarray(PAGES.slots([0, 1, 2, 3], positions)))
    cache = KVCache.create(config, PAGES.num_blocks + extra_blocks, PAGES.block_size, make_mesh(1))
    args = (state, cache, jnp.asarray([1, 2, 3, 4], jnp.int32), jnp.asarray(positions, jnp.int32), attn)
    return step, args


def program_lines(config, scan_layers: bool) -> int:
    step, args = decode_step(config, scan_layers)
    return len(step.lower(*args).as_text().splitlines())


def test_program_does_not_grow_with_depth():
    shallow, deep = (dataclasses.replace(CONFIG, num_layers=n) for n in (2, 8))
    assert program_lines(deep, True) == program_lines(shallow, True)
    # Unrolled, each layer is its own copy of the program (what the loop saves in compiling).
    assert program_lines(deep, False) > 3 * program_lines(shallow, False)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_step_updates_the_cache_in_place(scan_layers):
    """The step's scratch memory does not grow with the cache: the loop carries the donated
    cache and writes only the step's tokens into it, never a copy of it."""
    config = dataclasses.replace(CONFIG, num_layers=4)
    temps = []
    for extra in (0, 3 * PAGES.num_blocks):
        step, args = decode_step(config, scan_layers, extra)
        compiled = step.lower(*args).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        cache = args[1]
        logits, out = compiled(*args)
        assert cache.k.is_deleted() and out.k.shape == cache.k.shape and np.isfinite(np.asarray(logits)).all()
    grown = 3 * PAGES.num_blocks * KVCache.create(config, 2, PAGES.block_size, make_mesh(1)).bytes_per_block
    assert temps[1] - temps[0] < grown / 100, (temps, grown)
