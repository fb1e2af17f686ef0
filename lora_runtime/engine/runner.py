"""The jitted prefill and decode steps of one replica, with their fixed set of shapes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.kv_cache import AttentionMetadata, KVCache
from lora_runtime.engine.sampling import SamplingBatch, apply_penalties, sample, step_logprobs
from lora_runtime.lora.batch_info import LoRABatchInfo
from lora_runtime.lora.backend.base import BaseLoRABackend
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.llama import LlamaModel


@dataclasses.dataclass
class StepInputs:
    """Host arrays of one step; every shape is one of the runner's compiled shapes."""

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    rows: np.ndarray  # i32[T], -1 = padding / idle row
    sampling: SamplingBatch  # [P] rows sampled this step
    last_index: np.ndarray | None  # i32[P]: prefill only, index of each sequence's last token
    lora: LoRABatchInfo | None  # token slots of the T tokens
    seq_rows: np.ndarray | None = None  # i32[P]: prefill only, each sequence's cache row (-1: none)


@dataclasses.dataclass
class Sampled:
    """A step's sampled token per row, with log-probabilities (see sampling.StepLogprobs)."""

    tokens: np.ndarray  # i32[P]
    logprob: np.ndarray  # f32[P]
    top_ids: np.ndarray  # i32[P, K]
    top_logprobs: np.ndarray  # f32[P, K]

    @classmethod
    def from_device(cls, tokens, logprobs) -> "Sampled":
        tokens, logprobs = jax.device_get((tokens, logprobs))
        return cls(np.asarray(tokens), np.asarray(logprobs.chosen), np.asarray(logprobs.top_ids),
                   np.asarray(logprobs.top))


class ModelRunner:
    """Owns the model state, the KV cache and the compiled steps; not thread-safe."""

    def __init__(
        self,
        model: LlamaModel,
        model_config: ModelConfig,
        config: EngineConfig,
        mesh: jax.sharding.Mesh,
        backend: BaseLoRABackend | None,
    ):
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.backend = backend
        self.graphdef, self.state = nnx.split(model)
        self._create_state()
        self.traces = 0  # how many times a step was traced, i.e. compiled
        self._prefill = jax.jit(functools.partial(self._prefill_impl, mode="prefill"), donate_argnums=(1, 2, 3))
        self._extend = jax.jit(functools.partial(self._prefill_impl, mode="extend"), donate_argnums=(1, 2, 3))
        self._extend_rows = jax.jit(functools.partial(self._prefill_impl, mode="extend_rows"),
                                    donate_argnums=(1, 2, 3))
        self._copy_row = jax.jit(self._copy_row_impl, donate_argnums=(0,))
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1, 2, 3))
        # Prompt log-probabilities from the last prefill's hidden states, compiled per bucket
        # on first use (only requests that ask pay for the [T, vocab] logits).
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_impl)
        self._last_hidden = None

    def _create_state(self) -> None:
        """The KV cache and the per-row token state the steps donate and return."""
        config, mesh = self.config, self.mesh
        self.kv_cache = KVCache.create(self.model_config, config.max_batch, config.max_seq_len, mesh)
        # How often each cache row's sequence generated each token (presence/frequency penalties).
        replicated = NamedSharding(mesh, PartitionSpec())
        rows_by_vocab = (config.max_batch, self.model_config.vocab_size)
        self.token_counts = jax.device_put(jnp.zeros(rows_by_vocab, jnp.int32), replicated)
        # Which tokens each row's prompt holds (the repetition penalty covers them too).
        self.prompt_seen = jax.device_put(jnp.zeros(rows_by_vocab, bool), replicated)

    def reset_if_lost(self) -> bool:
        """After a failed step: recreates the cache and row state if the step had consumed
        (donated) them, so the next step runs; True if it did."""
        arrays = (*self.kv_cache.k, *self.kv_cache.v, self.token_counts, self.prompt_seen)
        if not any(a.is_deleted() for a in arrays):
            return False
        for a in arrays:
            if not a.is_deleted():
                a.delete()  # free the survivors before allocating afresh
        self._create_state()
        return True

    def _forward(self, state, kv_cache, pool, tokens, positions, rows, lora_info, mode, sequences=0):
        self.traces += 1  # runs only while tracing
        model = nnx.merge(self.graphdef, state)
        hook = None
        if pool is not None:
            from lora_runtime.lora.hook import PoolLoRAHook

            hook = PoolLoRAHook(self.backend, pool, lora_info, prefill=mode != "decode")
        attn = AttentionMetadata(rows=rows, mode=mode, sequences=sequences)
        hidden, kv_cache = model(tokens, positions, kv_cache, attn, hook)
        return model, hidden, kv_cache

    def _prefill_impl(self, state, kv_cache, counts, seen, pool, tokens, positions, rows, last_index, seq_rows,
                      seen_tokens, seen_rows, sampling, lora_info, *, mode):
        # extend_rows: one sequence per sampled row, C tokens each.
        sequences = last_index.shape[0] if mode == "extend_rows" else 0
        model, hidden, kv_cache = self._forward(
            state, kv_cache, pool, tokens, positions, rows, lora_info, mode, sequences
        )
        logits = model.logits(hidden[last_index])
        # A sequence whose prompt is complete starts its counts afresh and marks its prompt's
        # tokens (seen_tokens of seen_rows); -1 rows fall off the end.
        n_rows = counts.shape[0]
        count_rows = jnp.where(seq_rows >= 0, seq_rows, n_rows)
        counts = counts.at[count_rows].set(0, mode="drop")
        seen = seen.at[count_rows].set(False, mode="drop").at[
            jnp.where(seen_rows >= 0, seen_rows, n_rows), seen_tokens].set(True, mode="drop")
        row_of = jnp.clip(seq_rows, 0, n_rows - 1)
        penalized = apply_penalties(logits, counts[row_of], seen[row_of], sampling)
        next_tokens = sample(penalized, sampling)
        counts = counts.at[count_rows, next_tokens].add(1, mode="drop")
        return next_tokens, step_logprobs(logits, next_tokens), kv_cache, counts, seen, hidden

    @staticmethod
    def _copy_row_impl(kv_cache: KVCache, src, dst) -> KVCache:
        def copy(layer):
            row = jax.lax.dynamic_index_in_dim(layer, src, axis=0, keepdims=True)
            return jax.lax.dynamic_update_index_in_dim(layer, row, dst, axis=0)

        return KVCache(k=tuple(map(copy, kv_cache.k)), v=tuple(map(copy, kv_cache.v)))

    def _prompt_logprobs_impl(self, state, hidden, next_tokens):
        model = nnx.merge(self.graphdef, state)
        return step_logprobs(model.logits(hidden), next_tokens)

    def _decode_impl(self, state, kv_cache, counts, seen, pool, tokens, positions, rows, sampling, lora_info):
        model, hidden, kv_cache = self._forward(
            state, kv_cache, pool, tokens, positions, rows, lora_info, "decode"
        )
        logits = model.logits(hidden)  # row b of the batch is cache row b
        tokens = sample(apply_penalties(logits, counts, seen, sampling), sampling)
        count_rows = jnp.where(rows >= 0, jnp.arange(rows.shape[0]), counts.shape[0])
        counts = counts.at[count_rows, tokens].add(1, mode="drop")
        # Log-probabilities are the model's own, before penalties (as sampling params leave them).
        return tokens, step_logprobs(logits, tokens), kv_cache, counts, seen

    def prefill(self, inputs: StepInputs, pool) -> Sampled:
        """Runs one packed prefill step; returns the first sampled token of each row."""
        return self._run_prefill(self._prefill, inputs, pool, inputs.tokens, inputs.rows)

    def extend(self, inputs: StepInputs, prompts: np.ndarray, pool) -> Sampled:
        """Runs one chunk of one sequence over what its cache row already holds.

        `prompts` (i32[1, max_seq_len], -1 padded) is the sequence's whole prompt, marked as seen
        when ``inputs.seq_rows`` names the row (the last chunk, which samples the first token).
        """
        return self._run_prefill(self._extend, inputs, pool, *self._seen(prompts, inputs.seq_rows))

    def extend_rows(self, inputs: StepInputs, prompts: np.ndarray, pool) -> Sampled:
        """Runs short chunks of E sequences, C tokens each (sequence e's in tokens
        [e * C, (e + 1) * C)); E = len(inputs.seq_rows); `prompts` is i32[E, max_seq_len],
        as in extend."""
        return self._run_prefill(self._extend_rows, inputs, pool, *self._seen(prompts, inputs.seq_rows))

    @staticmethod
    def _seen(prompts: np.ndarray, seq_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each sampled sequence's prompt tokens, and the row to mark them in (-1: none)."""
        rows = np.where((prompts >= 0) & (seq_rows[:, None] >= 0), seq_rows[:, None], -1).astype(np.int32)
        return np.maximum(prompts, 0).ravel(), rows.ravel()

    def _run_prefill(self, step, inputs: StepInputs, pool, seen_tokens, seen_rows) -> Sampled:
        with jax.set_mesh(self.mesh):
            tokens, logprobs, self.kv_cache, self.token_counts, self.prompt_seen, self._last_hidden = step(
                self.state, self.kv_cache, self.token_counts, self.prompt_seen, pool, inputs.tokens, inputs.positions,
                inputs.rows, inputs.last_index, inputs.seq_rows, seen_tokens, seen_rows, inputs.sampling, inputs.lora,
            )
        return Sampled.from_device(tokens, logprobs)

    def copy_row(self, src: int, dst: int) -> None:
        """Copies cache row `src` into row `dst` (a cached prefix for a new sequence)."""
        with jax.set_mesh(self.mesh):
            self.kv_cache = self._copy_row(self.kv_cache, np.int32(src), np.int32(dst))

    def prompt_logprobs(self, next_tokens: np.ndarray) -> Sampled:
        """Log-probabilities at every position of the last prefill: of `next_tokens[t]` (the
        prompt token after position t) and the likeliest tokens there."""
        if self._last_hidden is None:
            raise RuntimeError("prompt_logprobs needs a prefill first")
        with jax.set_mesh(self.mesh):
            logprobs = self._prompt_logprobs(self.state, self._last_hidden, next_tokens)
        return Sampled.from_device(next_tokens, logprobs)

    def decode(self, inputs: StepInputs, pool) -> Sampled:
        """Runs one decode step over every cache row; returns a token per row."""
        with jax.set_mesh(self.mesh):
            tokens, logprobs, self.kv_cache, self.token_counts, self.prompt_seen = self._decode(
                self.state, self.kv_cache, self.token_counts, self.prompt_seen, pool, inputs.tokens, inputs.positions,
                inputs.rows, inputs.sampling, inputs.lora,
            )
        return Sampled.from_device(tokens, logprobs)
