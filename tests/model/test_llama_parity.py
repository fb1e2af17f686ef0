"""Our model's logits and greedy tokens match transformers' for every family, on 1 and 4 devices."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.helpers.paged import RowPages
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.llama import rope_attention_factor, rope_inv_freq
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from tests.model.conftest import FAMILIES, TP_FAMILIES, build_hf_model, save_checkpoint

# Lengths > the mistral window (4), packed in one prefill with trailing padding.
PROMPT_LENS = (7, 3, 10)
ROWS = (2, 0, 3)  # cache row of each prompt; row 1 stays idle
NUM_ROWS, MAX_SEQ = 4, 32
PAD = 3
DECODE_STEPS = 4
TOL = 1e-4


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def prompts(vocab: int, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, n).tolist() for n in lens]


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:  # f32[L, V]
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].numpy()


def make_step(model):
    """The forward + logits, jitted with the KV cache donated, as the engine runs it."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(4,))
    def step(state, tokens, positions, attn, cache):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens, positions, cache, attn)
        return m.logits(hidden), cache

    return functools.partial(step, state)


def prefill_batch(pages: RowPages, seqs: list[list[int]]):
    tokens, positions, rows = [], [], []
    for seq, row in zip(seqs, ROWS):
        tokens += seq
        positions += range(len(seq))
        rows += [row] * len(seq)
    tokens += [0] * PAD
    positions += [0] * PAD
    rows += [-1] * PAD
    as_i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return as_i32(tokens), as_i32(positions), pages.prefill(rows, positions)


def decode_batch(pages: RowPages, next_tokens: dict[int, int], lengths: dict[int, int]):
    """One token per cache row; rows absent from ``next_tokens`` are idle (-1)."""
    tokens = np.zeros(NUM_ROWS, np.int32)
    positions = np.zeros(NUM_ROWS, np.int32)
    rows = np.full(NUM_ROWS, -1, np.int32)
    for row, tok in next_tokens.items():
        tokens[row], positions[row], rows[row] = tok, lengths[row], row
    return jnp.asarray(tokens), jnp.asarray(positions), pages.decode(rows, positions)


def check_prefill_and_decode(hf_model, path, mesh, prompt_lens=PROMPT_LENS, max_seq=MAX_SEQ):
    """Packed prefill then step-by-step decode; every step's logits against HF's full forward."""
    config, model = load_model(str(path), mesh)
    step = make_step(model)
    seqs = prompts(config.vocab_size, prompt_lens)
    rng = np.random.default_rng(11)
    continuations = [rng.integers(3, config.vocab_size, DECODE_STEPS).tolist() for _ in seqs]
    refs = [hf_logits(hf_model, s + c) for s, c in zip(seqs, continuations)]

    pages = RowPages(NUM_ROWS, max_seq)
    cache = pages.cache(config, mesh)
    logits, cache = step(*prefill_batch(pages, seqs), cache)
    logits = np.asarray(logits)
    assert logits.shape == (sum(prompt_lens) + PAD, config.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    start = 0
    for seq, ref in zip(seqs, refs):
        assert rel_err(logits[start : start + len(seq)], ref[: len(seq)]) < TOL
        start += len(seq)

    lengths = {row: len(s) for row, s in zip(ROWS, seqs)}
    for t in range(DECODE_STEPS):
        logits, cache = step(*decode_batch(pages, {row: c[t] for row, c in zip(ROWS, continuations)}, lengths), cache)
        logits = np.asarray(logits)
        for row, seq, ref in zip(ROWS, seqs, refs):
            assert rel_err(logits[row], ref[len(seq) + t]) < TOL, (t, row)
        lengths = {row: n + 1 for row, n in lengths.items()}


def greedy(config, model, mesh, seqs: list[list[int]], n: int) -> list[list[int]]:
    """Greedy generation of ``n`` tokens per prompt: one packed prefill, then batched decode."""
    step = make_step(model)
    pages = RowPages(NUM_ROWS, MAX_SEQ)
    cache = pages.cache(config, mesh)
    logits, cache = step(*prefill_batch(pages, seqs), cache)
    ends = np.cumsum([len(s) for s in seqs]) - 1
    next_tok = {row: int(np.argmax(logits[e])) for row, e in zip(ROWS, ends)}
    lengths = {row: len(s) for row, s in zip(ROWS, seqs)}
    out = {row: [tok] for row, tok in next_tok.items()}
    for _ in range(n - 1):
        logits, cache = step(*decode_batch(pages, next_tok, lengths), cache)
        next_tok = {row: int(np.argmax(logits[row])) for row in next_tok}
        lengths = {row: n + 1 for row, n in lengths.items()}
        for row, tok in next_tok.items():
            out[row].append(tok)
    return [out[row] for row in ROWS]


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_match_transformers(hf_checkpoints, family):
    hf_model, path = hf_checkpoints[family]
    check_prefill_and_decode(hf_model, path, make_mesh(1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(hf_checkpoints, family):
    hf_model, path = hf_checkpoints[family]
    mesh = make_mesh(1)
    config, model = load_model(str(path), mesh)
    seqs = prompts(config.vocab_size)
    n = 8
    ours = greedy(config, model, mesh, seqs, n)
    theirs = [hf_greedy(hf_model, s, n) for s in seqs]
    assert ours == theirs
    # Random weights could in principle collapse to one repeated token; these do not.
    assert len({t for seq in ours for t in seq}) > 3


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tensor_parallel_matches_transformers(hf_checkpoints, family):
    hf_model, path = hf_checkpoints[family]
    mesh = make_mesh(4)
    check_prefill_and_decode(hf_model, path, mesh)
    config, model = load_model(str(path), mesh)
    q = model.layers.self_attn.q_proj.kernel[...]  # [L, hidden, q]
    assert len(q.sharding.device_set) == 4 and q.addressable_shards[0].data.shape[2] == q.shape[2] // 4
    seqs = prompts(config.vocab_size)
    assert greedy(config, model, mesh, seqs, 4) == [hf_greedy(hf_model, s, 4) for s in seqs]


# Past a 32-token original context (max_position_embeddings 128), so yarn's scaling shows.
LONG_PROMPT_LENS = (40, 9, 50)
LONG_MAX_SEQ = 64
ROPE_SCALED = {
    "qwen2_yarn": ("qwen2", dict(rope_theta=500.0, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    # head_dim 32: more frequencies in the ramp; untruncated ramp; attention factor from the mscales
    "llama_yarn_mscale": ("llama", dict(head_dim=32, rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.5,
        beta_fast=16, truncate=False))),
    # transformers keeps plain RoPE up to max_position_embeddings
    "llama_dynamic": ("llama", dict(max_position_embeddings=64, rope_scaling=dict(type="dynamic", factor=2.0))),
}


@pytest.mark.parametrize("name", list(ROPE_SCALED))
def test_rope_scaling_matches_transformers_past_the_original_context(tmp_path, name):
    family, overrides = ROPE_SCALED[name]
    hf_model = build_hf_model(family, **overrides)
    path = save_checkpoint(hf_model, tmp_path)
    config = ModelConfig.from_pretrained(str(path))
    scaling = config.rope_scaling
    assert scaling.rope_type == overrides["rope_scaling"].get("rope_type", overrides["rope_scaling"].get("type"))
    if scaling.rope_type == "yarn":
        plain = dataclasses.replace(config, rope_scaling=None)
        assert not np.allclose(rope_inv_freq(config), rope_inv_freq(plain))
        assert rope_attention_factor(config) > 1.01
        assert max(LONG_PROMPT_LENS) > scaling.original_max_position_embeddings
    else:
        config.check_max_seq_len(LONG_MAX_SEQ)
    check_prefill_and_decode(hf_model, path, make_mesh(1), LONG_PROMPT_LENS, LONG_MAX_SEQ)


@pytest.mark.parametrize("hidden_act", ["gelu_pytorch_tanh", "relu2"])
def test_a_checkpoints_hidden_act_is_the_one_computed(tmp_path, hidden_act):
    hf_model = build_hf_model("llama", hidden_act=hidden_act)
    path = save_checkpoint(hf_model, tmp_path)
    assert ModelConfig.from_pretrained(str(path)).hidden_act == hidden_act
    check_prefill_and_decode(hf_model, path, make_mesh(1))
