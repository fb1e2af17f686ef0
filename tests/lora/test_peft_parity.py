"""One packed prefill mixing adapters of different ranks and options (DoRA, embedding and
lm_head adapters among them) matches PEFT per request."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers.paged import RowPages
from lora_runtime.lora.backend.reference import ReferenceLoRABackend
from lora_runtime.lora.base_weights import BaseWeights
from lora_runtime.lora.hook import PoolLoRAHook
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.lora.sources import SourcePolicy
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from tests.lora.peft_adapters import peft_logits

TOL = 1e-4
# (adapter or None, prompt length); two requests share "r4", two use no adapter.
REQUESTS = [("r4", 6), (None, 5), ("r8_rslora", 7), ("r16_pattern", 4), ("r8_layer1", 6), ("r4", 3), (None, 4),
            ("dora", 5), ("embed_head", 6), ("dora_head", 4), ("dora", 3), ("bias", 5)]
PAD = 3


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def prompts(model_config) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, model_config.vocab_size, n).tolist() for _, n in REQUESTS]


@pytest.fixture(scope="module")
def all_dirs(adapter_dirs, extra_adapter_dirs):
    return {**adapter_dirs, **extra_adapter_dirs}


@pytest.fixture(scope="module")
def reference(base_dir, all_dirs, prompts) -> list[np.ndarray]:
    return [peft_logits(base_dir, None if a is None else all_dirs[a], ids)
            for (a, _), ids in zip(REQUESTS, prompts)]


def test_adapters_change_the_logits(base_dir, reference, prompts):
    """Guards the parity test: every adapter moves its request's logits well past the tolerance."""
    for (adapter, _), ids, ref in zip(REQUESTS, prompts, reference):
        if adapter is not None:
            assert rel_err(peft_logits(base_dir, None, ids), ref) > 100 * TOL, adapter


# A rank-aware pool: ranks 4 / 8 / 16 in classes too small for some, so adapters spill wider.
RANK_CLASSES = ((4, 1), (8, 2), (16, 5))


@pytest.mark.parametrize("tp,classes", [(1, None), (4, None), (1, RANK_CLASSES), (4, RANK_CLASSES)])
def test_mixed_adapter_prefill_matches_peft(tp, classes, base_dir, all_dirs, prompts, reference):
    mesh = make_mesh(tp, jax.devices()[:tp])
    config, model = load_model(str(base_dir), mesh)
    shape = dict(num_slots=len(all_dirs)) if classes is None else dict(rank_classes=classes)
    manager = LoRAManager(config, mesh, **shape, max_lora_rank=16, max_cpu_loras=8,
                          max_cpu_bytes=1 << 24,
                          source_policy=SourcePolicy(allowed_roots=None, max_adapter_bytes=1 << 24),
                          dtype=config.dtype, base_weights=BaseWeights(model), outer=True, dora=True,
                          bias=True)
    for name, path in all_dirs.items():
        manager.register(name, str(path))
    tokens, positions, rows, token_slots = [], [], [], []
    for row, ((adapter, _), ids) in enumerate(zip(REQUESTS, prompts)):
        slot = -1 if adapter is None else manager.acquire_slot(adapter)
        tokens += ids
        positions += range(len(ids))
        rows += [row] * len(ids)
        token_slots += [slot] * len(ids)
    tokens += [0] * PAD
    positions += [0] * PAD
    rows += [-1] * PAD
    token_slots += [-1] * PAD
    info = manager.prepare_lora_batch(np.array(token_slots, np.int32))
    backend = ReferenceLoRABackend(mesh)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(5,))
    def step(state, pool, tokens, positions, attn, cache, info):
        m = nnx.merge(graphdef, state)
        hook = PoolLoRAHook(backend, pool, info, prefill=True)
        hidden, cache = m(tokens, positions, cache, attn, lora=hook)
        return m.logits(hidden, hook), cache

    pages = RowPages(len(REQUESTS), 16)
    cache = pages.cache(config, mesh)
    as_i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    logits, _ = step(state, manager.pool, as_i32(tokens), as_i32(positions), pages.prefill(rows, positions),
                     cache, info)
    logits = np.asarray(logits)
    if classes is not None:  # every class in use, one adapter spilled into a wider class
        ranks = {e["name"]: e["slot_rank"] for e in manager.list_adapters()}
        assert set(ranks.values()) == {4, 8, 16} and ranks["embed_head"] > 4, ranks
    start = 0
    for (adapter, n), ref in zip(REQUESTS, reference):
        err = rel_err(logits[start:start + n], ref)
        assert err < TOL, f"{adapter=} {tp=} {classes=} {err=}"
        start += n
    manager.close()
