"""The on-device sampler of a whole batch (a request's parameters: sampling_params.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lora_runtime.engine.sampling_params import (  # noqa: F401  (re-exported)
    MAX_HELD_BACK_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as device arrays."""

    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]: 0 keeps every token
    seed: jax.Array  # u32[B, 2]: the request seed split into two 32-bit words
    step: jax.Array  # i32[B]: tokens generated so far, so each step draws fresh noise
    presence: jax.Array  # f32[B]
    frequency: jax.Array  # f32[B]
    repetition: jax.Array  # f32[B]
    held_back: jax.Array  # i32[B, MAX_HELD_BACK_IDS]: token ids banned while step < min_tokens (-1 pads)
    min_tokens: jax.Array  # i32[B]
    bias_ids: jax.Array  # i32[B, MAX_LOGIT_BIAS]: logit_bias token ids (-1 pads)
    bias: jax.Array  # f32[B, MAX_LOGIT_BIAS]: what each adds to its logit
    want_logprobs: jax.Array  # bool[B]: the row's request asked for log-probabilities

    @property
    def any_logprobs(self) -> bool:
        """Whether some row asked for log-probabilities (host arrays only)."""
        return bool(np.asarray(self.want_logprobs).any())

    @classmethod
    def from_rows(
        cls, rows: list[tuple[SamplingParams, int, int] | None], eos_token_ids: Seq[int] = ()
    ) -> "SamplingBatch":
        """rows[i] = (params, seed, tokens generated so far), or None for an idle row;
        `eos_token_ids`: what min_tokens holds back besides a request's stop_token_ids."""
        n = len(rows)
        temperature = np.zeros(n, np.float32)
        top_k = np.zeros(n, np.int32)
        top_p = np.ones(n, np.float32)
        min_p = np.zeros(n, np.float32)
        seed = np.zeros((n, 2), np.uint32)
        step = np.zeros(n, np.int32)
        presence = np.zeros(n, np.float32)
        frequency = np.zeros(n, np.float32)
        repetition = np.ones(n, np.float32)
        held_back = np.full((n, MAX_HELD_BACK_IDS), -1, np.int32)
        min_tokens = np.zeros(n, np.int32)
        bias_ids = np.full((n, MAX_LOGIT_BIAS), -1, np.int32)
        bias = np.zeros((n, MAX_LOGIT_BIAS), np.float32)
        want_logprobs = np.zeros(n, bool)
        eos = sorted(eos_token_ids)[:4]
        for i, row in enumerate(rows):
            if row is None:
                continue
            params, s, generated = row
            temperature[i] = params.temperature
            top_k[i] = params.top_k
            top_p[i] = params.top_p
            min_p[i] = params.min_p
            seed[i] = (s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF
            step[i] = generated
            presence[i] = params.presence_penalty
            frequency[i] = params.frequency_penalty
            repetition[i] = params.repetition_penalty
            if params.min_tokens > generated:
                ids = list(params.stop_token_ids) + ([] if params.ignore_eos else eos)
                held_back[i, : len(ids)] = ids
                min_tokens[i] = params.min_tokens
            for j, (token, value) in enumerate(params.logit_bias):
                bias_ids[i, j], bias[i, j] = token, value
            want_logprobs[i] = params.logprobs is not None
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step,
                   presence=presence, frequency=frequency, repetition=repetition, held_back=held_back,
                   min_tokens=min_tokens, bias_ids=bias_ids, bias=bias, want_logprobs=want_logprobs)


def apply_penalties(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array, batch: SamplingBatch,
                    row_of: jax.Array | None = None) -> jax.Array:
    """The row's logits after its penalties and min_tokens (f32[B, V] -> f32[B, V]).

    counts: i32[N, V], how often each batch row already generated each token; in_prompt:
    bool[N, V]; logit row b reads batch row row_of[b] (i32[B]; None: row b, N = B).
    HF's repetition penalty over prompt and output tokens: a positive logit divided by it, a
    negative one multiplied. Then OpenAI's presence and frequency penalties: logit -
    frequency * count - presence * [count > 0]. Then logit_bias is added. min_tokens: the
    held-back ids get -inf until then. Each part runs only when some row of the step asks
    for it (a branch on device): a batch without penalties never reads the [B, V] counts.
    """
    logits = logits.astype(jnp.float32)
    penalized = jnp.any((batch.repetition != 1.0) | (batch.presence != 0.0) | (batch.frequency != 0.0))
    if row_of is None:
        row_of = jnp.arange(logits.shape[0])
    logits = lax.cond(penalized, _penalize, lambda lg, *_: lg, logits, counts, in_prompt, row_of, batch)
    rows = jnp.arange(logits.shape[0])[:, None]
    hold = (batch.step < batch.min_tokens)[:, None] & (batch.held_back >= 0)
    biased = jnp.any(batch.bias_ids >= 0)

    def bias_and_hold(logits):
        bias_cols = jnp.where(batch.bias_ids >= 0, batch.bias_ids, logits.shape[1])  # out of range: dropped
        logits = logits.at[rows, bias_cols].add(batch.bias, mode="drop")
        cols = jnp.where(hold, batch.held_back, logits.shape[1])
        return logits.at[rows, cols].set(-jnp.inf, mode="drop")

    return lax.cond(biased | jnp.any(hold), bias_and_hold, lambda lg: lg, logits)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """The logits with every token a row's grammar does not allow at -inf (f32[B, V]).

    mask: i32[B, ceil(V / 32)], bit t % 32 of word t // 32 allows token t (llguidance's
    layout); a row without a grammar has every bit set. If what the request's penalties
    and min_tokens left of a row allows nothing the grammar does (min_tokens holding back
    the EOS that alone may end it), the grammar wins: its allowed tokens get equal logits.
    """
    b, v = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=mask.dtype)) & 1
    allowed = bits.reshape(b, -1)[:, :v] != 0
    masked = jnp.where(allowed, logits, -jnp.inf)
    dead = jnp.all(masked == -jnp.inf, axis=-1, keepdims=True)
    return jnp.where(dead, jnp.where(allowed, 0.0, -jnp.inf), masked)


def _penalize(logits, counts, in_prompt, row_of, batch):
    counts, in_prompt = counts[row_of], in_prompt[row_of]
    seen = counts > 0
    rep = batch.repetition[:, None]  # first, as vLLM orders them
    logits = jnp.where(seen | in_prompt, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = counts.astype(jnp.float32)
    return logits - batch.frequency[:, None] * counts - batch.presence[:, None] * seen.astype(jnp.float32)


def _row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.wrap_key_data(seed, impl="threefry2x32")
    return jax.random.fold_in(key, step)


# Top-k/top-p look at the likeliest this many tokens first; a whole-vocabulary sort runs only
# for a row whose top-k reaches past them or whose nucleus is not inside them.
TOP_CANDIDATES = 1024
# Rows that need the whole-vocabulary sort are sorted this many at a time (the rest one
# by one): the cost follows the rows that need it, never the batch.
FULL_SORT_ROWS = 4


def _top_k_top_p(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:  # f32[B, V]
    """-inf outside each row's top-k, then outside the top-p nucleus of those."""
    vocab = scaled.shape[-1]
    k = jnp.where(batch.top_k > 0, jnp.minimum(batch.top_k, vocab), vocab)
    if vocab <= TOP_CANDIDATES:
        return _filter_sorted(scaled, -jnp.sort(-scaled, axis=-1), k, batch.top_p, jax.nn.logsumexp)
    cands = jax.lax.top_k(scaled, TOP_CANDIDATES)[0]  # [B, C], likeliest first
    ranks = jnp.arange(TOP_CANDIDATES)[None, :]
    # The top-k survivors' normalizer: from the candidates when k fits in them, else (no
    # top-k) over the whole row.
    full_norm = jax.nn.logsumexp(scaled, axis=-1)
    cand_norm = jax.nn.logsumexp(jnp.where(ranks < k[:, None], cands, -jnp.inf), axis=-1)
    norm = jnp.where(k <= TOP_CANDIDATES, cand_norm, full_norm)
    cand_mass = jnp.sum(jnp.where(ranks < k[:, None], jnp.exp(cands - norm[:, None]), 0.0), axis=-1)
    fits = (k <= TOP_CANDIDATES) | ((k == vocab) & ((cand_mass >= batch.top_p) | (batch.top_p >= 1.0)))
    fast = _filter_sorted(scaled, cands, k, batch.top_p, lambda v, axis: norm)
    return lax.cond(jnp.all(fits), lambda m: m, lambda m: _sort_rows(m, scaled, k, batch.top_p, ~fits), fast)


def _sort_rows(masked, scaled, k, top_p, rows_needing):
    """`masked` with the rows in `rows_needing` (bool[B]) filtered over their whole sorted
    vocabulary: FULL_SORT_ROWS rows at a time, then the rest one at a time, so one such
    row costs one row's sort."""
    n = scaled.shape[0]
    top_p = jnp.asarray(top_p)
    chunk = min(FULL_SORT_ROWS, n)
    # Rows needing the sort first (stable), padded with an out-of-range row.
    order = jnp.argsort(~rows_needing, stable=True).astype(jnp.int32)
    order = jnp.concatenate([order, jnp.full((chunk,), n, jnp.int32)])
    count = jnp.sum(rows_needing.astype(jnp.int32))

    def sort_from(start, size, masked):
        idx = lax.dynamic_slice(order, (start,), (size,))
        safe = jnp.minimum(idx, n - 1)
        rows = scaled[safe]
        filtered = _filter_sorted(rows, -jnp.sort(-rows, axis=-1), k[safe], top_p[safe], jax.nn.logsumexp)
        return masked.at[jnp.where(idx < n, idx, n)].set(filtered, mode="drop")

    whole = count // chunk
    masked = lax.fori_loop(0, whole, lambda i, m: sort_from(i * chunk, chunk, m), masked)
    return lax.fori_loop(whole * chunk, count, lambda i, m: sort_from(i, 1, m), masked)


def _filter_sorted(scaled, sorted_desc, k, top_p, normalizer):
    """The top-k/top-p mask from a descending prefix of each row (the whole row, or its
    likeliest candidates when the kept tokens are among them); `normalizer(values, axis)`
    is the log of the top-k survivors' total mass."""
    n = sorted_desc.shape[-1]
    ranks = jnp.arange(n)[None, :]
    kth = jnp.take_along_axis(sorted_desc, (jnp.minimum(k, n) - 1)[:, None], axis=-1)
    kth = jnp.where((k <= n)[:, None], kth, -jnp.inf)
    sorted_kept = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    log_norm = normalizer(sorted_kept, axis=-1)
    probs = jnp.exp(sorted_kept - log_norm[:, None])
    # top-p over the top-k survivors: keep the smallest prefix whose mass reaches p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = (mass_before < top_p[:, None]) & (ranks < k[:, None])
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    # top_p = 1 keeps every top-k survivor (rounding must not drop the far tail).
    cutoff = jnp.where((top_p >= 1.0)[:, None], -jnp.inf, cutoff)
    threshold = jnp.maximum(kth, cutoff)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:  # f32[B, V]
    """-inf where a token's probability is below min_p times the row's likeliest: a ratio of
    probabilities, so a difference of logits, with no normalizer (log 0 = -inf keeps all)."""
    threshold = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, batch: SamplingBatch) -> jax.Array:  # f32[B, V] -> i32[B]
    """Greedy where temperature is 0; otherwise temperature, min-p, top-k, then top-p
    sampling (min-p before top-p, as vLLM orders them: the nucleus is of what min-p kept).

    A row's draw depends only on its own seed and step, not on the rest of the batch,
    so a seeded request gives the same tokens however it is batched. The vocabulary sort
    runs only when some row asks for top-k or top-p, and the draw only when some row
    samples: a whole-vocabulary sort per step costs more than the rest of sampling.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        scaled = logits / jnp.maximum(batch.temperature, 1e-6)[:, None]
        scaled = lax.cond(jnp.any(batch.min_p > 0), lambda s: _min_p(s, batch.min_p), lambda s: s, scaled)
        filtering = jnp.any((batch.top_k > 0) | (batch.top_p < 1.0))
        masked = lax.cond(filtering, lambda s: _top_k_top_p(s, batch), lambda s: s, scaled)
        keys = jax.vmap(_row_key)(batch.seed, batch.step)
        return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)

    sampling = jnp.any(batch.temperature > 0)
    drawn = lax.cond(sampling, draw, lambda logits: greedy, logits)
    return jnp.where(batch.temperature > 0, drawn, greedy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepLogprobs:
    """Log-probabilities of one step's rows under the model (before temperature or top-k/p)."""

    chosen: jax.Array  # f32[B]: of each row's sampled token
    top_ids: jax.Array  # i32[B, K]: the K likeliest tokens, likeliest first
    top: jax.Array  # f32[B, K]: their log-probabilities


def step_logprobs(
    logits: jax.Array,  # f32[B, V]
    tokens: jax.Array,  # i32[B]
    want: jax.Array | None = None,  # bool[B]: rows that asked; None: every row
) -> StepLogprobs:
    """The sampled tokens' log-probabilities and the MAX_LOGPROBS likeliest tokens per row.

    With `want`, a step where no row asked computes nothing (zeros): the vocabulary-wide
    softmax and top-k are a large share of a small model's step.
    """
    k = min(MAX_LOGPROBS, logits.shape[-1])

    def compute(logits, tokens):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        top, top_ids = jax.lax.top_k(logp, k)
        return StepLogprobs(chosen, top_ids.astype(jnp.int32), top)

    if want is None:
        return compute(logits, tokens)

    def nothing(logits, tokens):
        b = tokens.shape[0]
        return StepLogprobs(jnp.zeros(b, jnp.float32), jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32))

    return lax.cond(jnp.any(want), compute, nothing, logits, tokens)
