"""Sampling parameters of a request, and the on-device sampler of a whole batch."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lora_runtime.errors import InvalidRequestError

# Most alternatives a request may ask log-probabilities for (OpenAI's limit too).
MAX_LOGPROBS = 20
# Most token ids min_tokens holds back per row (the EOS ids and the request's stop_token_ids).
MAX_HELD_BACK_IDS = 32
# Most tokens one request may bias (logit_bias), and the bias's bound (OpenAI's: ±100).
MAX_LOGIT_BIAS = 300


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n likeliest
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (after the first)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was already generated
    repetition_penalty: float = 1.0  # HF/vLLM: divides positive, multiplies negative logits of seen tokens
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens are generated
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), OpenAI's

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raises InvalidRequestError naming the first bad field; returns self."""
        if self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens={self.max_tokens} must be >= 0")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature={self.temperature} must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed={self.seed} must be in [0, 2**63)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name}={value} must be in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name}={value} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(f"repetition_penalty={self.repetition_penalty} must be in (0, 2]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        if self.min_tokens and len(self.stop_token_ids) > MAX_HELD_BACK_IDS - 4:
            raise InvalidRequestError(
                f"min_tokens with {len(self.stop_token_ids)} stop_token_ids: at most {MAX_HELD_BACK_IDS - 4}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError(f"stop={list(self.stop)!r} contains an empty string")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"logit_bias names token {next(t for t in ids if ids.count(t) > 1)} twice")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias has {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}")
        out_of_range = [(t, v) for t, v in self.logit_bias if not -100.0 <= v <= 100.0]
        if out_of_range:
            raise InvalidRequestError(f"logit_bias value {out_of_range[0][1]} for token {out_of_range[0][0]} "
                                      f"must be in [-100, 100]")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"stop_token_ids {bad} outside [0, {vocab_size})")
            bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"logit_bias token ids {bad[:5]} outside [0, {vocab_size})")
        return self

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the tokens seen so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def resolved_seed(self) -> int:
        """The request's seed, or a fresh random one: each request gets its own stream."""
        return self.seed if self.seed is not None else secrets.randbits(62)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as device arrays."""

    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
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
        return cls(temperature, top_k, top_p, seed, step, presence, frequency, repetition, held_back, min_tokens,
                   bias_ids, bias, want_logprobs)


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


def sample(logits: jax.Array, batch: SamplingBatch) -> jax.Array:  # f32[B, V] -> i32[B]
    """Greedy where temperature is 0; otherwise temperature, top-k, then top-p sampling.

    A row's draw depends only on its own seed and step, not on the rest of the batch,
    so a seeded request gives the same tokens however it is batched. The vocabulary sort
    runs only when some row asks for top-k or top-p, and the draw only when some row
    samples: a whole-vocabulary sort per step costs more than the rest of sampling.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        scaled = logits / jnp.maximum(batch.temperature, 1e-6)[:, None]
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
