"""The jitted prefill and decode steps of one replica, with their fixed set of shapes."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.device_inputs import DeviceInputs
from lora_runtime.engine.program_store import ProgramStore
from lora_runtime.engine.sampling import SamplingBatch, apply_penalties, apply_token_mask, sample, step_logprobs
from lora_runtime.errors import HostLostError
from lora_runtime.lora.batch_info import LoRABatchInfo
from lora_runtime.lora.backend.base import BaseLoRABackend
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.kv_cache import AttentionMetadata, KVCache
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.sharding import zeros_on

# Row histories (init_rows) are padded to a power of two from this many tokens.
MIN_HISTORY = 64
# How long a failed step of a multi-host replica waits to learn whether a host died under it
# (the watcher of a dead host's connection sees it close within milliseconds).
HOST_LOSS_GRACE_S = 2.0

# Host work a step runs while its model forward computes on the device; it returns the
# step's allowed-token bitmask (i32[rows, ceil(vocab / 32)]), or None when no row has a grammar.
HostWork = Callable[[], "np.ndarray | None"]


@dataclasses.dataclass
class StepInputs:
    """Host arrays of one step; every shape is one of the runner's compiled shapes."""

    tokens: np.ndarray  # i32[T]; in a decode step, -1: the row's token the last decode step sampled (on the device)
    positions: np.ndarray  # i32[T]
    rows: np.ndarray  # i32[T]: each token's batch row, -1 = padding / idle row
    attn: AttentionMetadata  # where the tokens' K/V go and what they read
    sampling: SamplingBatch  # [P] rows sampled this step
    last_index: np.ndarray | None  # i32[P]: prefill only, index of each sequence's last token
    lora: LoRABatchInfo | None  # token slots of the T tokens
    seq_rows: np.ndarray | None = None  # i32[P]: prefill only, each sampled sequence's batch row (-1: none)


@dataclasses.dataclass
class Sampled:
    """A step's sampled token per row, with log-probabilities (see sampling.StepLogprobs)."""

    tokens: np.ndarray  # i32[P]
    logprob: np.ndarray  # f32[P]
    top_ids: np.ndarray  # i32[P, K]
    top_logprobs: np.ndarray  # f32[P, K]

    @classmethod
    def from_device(cls, tokens, logprobs, wanted: bool = True) -> "Sampled":
        """One device-to-host transfer: the tokens, with the log-probabilities if `wanted`."""
        if not wanted:
            tokens = np.asarray(jax.device_get(tokens))
            empty = np.zeros((tokens.shape[0], 0))
            return cls(tokens, np.zeros(tokens.shape[0], np.float32), empty.astype(np.int32),
                       empty.astype(np.float32))
        tokens, logprobs = jax.device_get((tokens, logprobs))
        return cls(np.asarray(tokens), np.asarray(logprobs.chosen), np.asarray(logprobs.top_ids),
                   np.asarray(logprobs.top))


@dataclasses.dataclass
class PendingSample:
    """A dispatched step's sampled tokens (and log-probabilities), still on the device."""

    tokens: jax.Array
    logprobs: object
    wanted: bool  # whether any row asked for log-probabilities

    def get(self) -> Sampled:
        """Waits for the step and brings its tokens (and asked-for log-probabilities) to the host."""
        return Sampled.from_device(self.tokens, self.logprobs, self.wanted)


def history_bucket(n: int) -> int:
    """The padded length of a row history of `n` tokens (init_rows)."""
    size = MIN_HISTORY
    while size < n:
        size *= 2
    return size


class ModelRunner:
    """Owns the model state, the paged KV cache and the compiled steps; not thread-safe."""

    def __init__(
        self,
        model: LlamaModel,
        model_config: ModelConfig,
        config: EngineConfig,
        mesh: jax.sharding.Mesh,
        backend: BaseLoRABackend | None,
        *,
        num_blocks: int,
        block_size: int,
        attention_platform: str = "xla",
        interpret: bool = False,
        page_head_dim: int | None = None,
        program_dir: str | None = None,
    ):
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.backend = backend
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.attention_platform = attention_platform
        self.interpret = interpret
        self.page_head_dim = page_head_dim or model_config.head_dim  # the cache pages' last dim (kv_cache.py)
        self.graphdef, self.state = nnx.split(model)
        self._create_state()
        # The model's steps return logits; sampling is a program of its own, compiled once per
        # row count and shared by every step shape (it is about half of a step's compile time).
        self._prefill = jax.jit(functools.partial(self._prefill_impl, mode="prefill"), donate_argnums=(1,))
        self._extend = jax.jit(functools.partial(self._prefill_impl, mode="paged"), donate_argnums=(1,))
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,))
        # What the host reads (tokens, log-probabilities) comes out whole on every device: on a
        # replica spanning hosts, each process can read it from its own devices.
        replicated = NamedSharding(mesh, PartitionSpec())
        self._sample = jax.jit(_sample_impl, donate_argnums=(1,), out_shardings=replicated)
        self._init_row = jax.jit(self._init_row_impl, donate_argnums=(0, 1))
        # Prompt log-probabilities from the last prefill's hidden states, compiled per bucket
        # on first use (only requests that ask pay for the [T, vocab] logits).
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_impl, out_shardings=replicated)
        self._logits = None  # the last forward's logits, which the next sample op reads
        self._decode_logits = False  # whether they are a decode step's (its sampled tokens are kept)
        self._last_hidden = None
        self._last_head = (None, None)  # the last prefill's pool and adapter batch, if its head has adapters
        # A multi-host replica's leader (engine/spmd.py): every device op goes to the followers first.
        self.mirror = None
        # The steps' programs, kept as exports under the compilation cache (program_store.py).
        self.programs = ProgramStore(program_dir, self._program_context())
        # The steps' small host inputs, kept on the device while they repeat (device_inputs.py).
        self.inputs = DeviceInputs(mesh)

    def _program_context(self) -> str:
        """What besides their arguments shapes the traced steps (ProgramStore's key)."""
        return "\n".join(map(repr, (
            self.graphdef, self.model_config, self.config.model_dump(mode="json"), type(self.backend).__qualname__,
            getattr(self.backend, "__dict__", None), self.attention_platform, self.interpret,
            self.page_head_dim, self.block_size, self.mesh.shape, self.mesh.axis_names)))

    def _create_state(self) -> None:
        """The KV cache and the per-row token state the steps donate and return."""
        config, mesh = self.config, self.mesh
        self.kv_cache = KVCache.create(self.model_config, self.num_blocks, self.block_size, mesh,
                                       head_dim=self.page_head_dim)
        # How often each batch row's sequence generated each token (presence/frequency penalties).
        replicated = NamedSharding(mesh, PartitionSpec())
        rows_by_vocab = (config.max_batch, self.model_config.vocab_size)
        self.token_counts = zeros_on(rows_by_vocab, jnp.int32, replicated)
        # Which tokens each row's prompt holds (the repetition penalty covers them too).
        self.prompt_seen = zeros_on(rows_by_vocab, bool, replicated)
        # The last decode step's sampled token per batch row, still on the device: the next decode
        # step's token of a row whose input token is -1 (the engine dispatches it before reading them).
        self.decode_tokens = zeros_on((config.max_batch,), jnp.int32, replicated)

    def reset_if_lost(self) -> bool:
        """After a failed step: recreates the cache and row state if the step had consumed
        (donated) them, so the next step runs; True if it did."""
        arrays = (*self.kv_cache.arrays, self.token_counts, self.prompt_seen)
        if not any(a.is_deleted() for a in arrays):
            return False
        self._op("reset_state")
        return True

    def failure_cause(self, err: Exception) -> Exception:
        """What a failed step's error means: on a multi-host replica that lost a host (now or
        within HOST_LOSS_GRACE_S), HostLostError, whatever the step raised (a collective whose
        peer died fails as an internal error of the runtime); else the error itself."""
        if self.mirror is None or isinstance(err, HostLostError):
            return err
        if not self.mirror.lost_within(HOST_LOSS_GRACE_S):
            return err
        try:
            self.mirror.check()
        except HostLostError as lost:
            lost.__cause__ = err
            return lost
        return err

    # ---- device ops ---------------------------------------------------------------------
    # Every device program a step launches goes through _op: on a multi-host replica's leader
    # it is first sent to the followers, which launch the same op_<name> with the same host
    # arguments on their shards (engine/spmd.py). Ops take host values only.

    def _op(self, name: str, *args):
        if self.mirror is None:
            return getattr(self, "op_" + name)(*args)
        with self.mirror.issuing("runner", name, args):
            return getattr(self, "op_" + name)(*args)

    def op_reset_state(self) -> None:
        """Frees whatever survived of the cache and row state and makes them afresh."""
        for a in (*self.kv_cache.arrays, self.token_counts, self.prompt_seen, self.decode_tokens):
            if not a.is_deleted():
                a.delete()  # free the survivors before allocating afresh
        self._create_state()

    def op_forward(self, kind: str, inputs: StepInputs, pool) -> None:
        """Launches a step's model forward ("prefill", "extend" or "decode"); its logits wait
        for the sample op."""
        self._decode_logits = kind == "decode"
        with jax.set_mesh(self.mesh):
            if kind == "decode":
                self._logits, self.kv_cache = self.programs.call("decode", self._decode,
                                                                 self._decode_args(inputs, pool))
                return
            step = self._prefill if kind == "prefill" else self._extend
            self._logits, self.kv_cache, self._last_hidden = self.programs.call(
                kind, step, self._prefill_args(kind, inputs, pool))
        self._last_head = _head_lora(inputs, pool)

    def op_idle_logits(self, rows: int) -> None:
        """Zero logits of `rows` rows for the next sample op (warm-up)."""
        self._decode_logits = False
        self._logits = zeros_on((rows, self.model_config.vocab_size), jnp.float32,
                                NamedSharding(self.mesh, PartitionSpec()))

    def op_sample(self, sampling: SamplingBatch, seq_rows: np.ndarray, mask: np.ndarray | None) -> "PendingSample":
        """Launches sampling a token per row of the last forward's logits; row i belongs to
        batch row seq_rows[i] (-1: none) and may draw only what row i of `mask` allows (None:
        anything; a program of its own)."""
        logits, self._logits = self._logits, None
        with jax.set_mesh(self.mesh):
            # Decode steps keep their own device copies of the sampling inputs: a prompt step's
            # between two of them does not make the next one send its unchanged rows again.
            copies = "sample" if self._decode_logits else "sample_prompt"
            tokens, logprobs, self.token_counts = self.programs.call(
                "sample", self._sample, self._sample_args(logits, sampling, seq_rows, mask, copies=copies))
        if self._decode_logits:
            self.decode_tokens = tokens
        # Their copy to the host starts when they are computed, not when get() asks: by then the
        # next step may be queued behind them (async_decode) and the copy would wait for it.
        for x in (tokens, *(jax.tree_util.tree_leaves(logprobs) if sampling.any_logprobs else ())):
            x.copy_to_host_async()
        return PendingSample(tokens, logprobs, sampling.any_logprobs)

    def op_init_row(self, row: int, history: np.ndarray, prompt_len: int) -> None:
        with jax.set_mesh(self.mesh):
            self.token_counts, self.prompt_seen = self._init_row(
                self.token_counts, self.prompt_seen, np.int32(row), history, np.int32(prompt_len))

    def op_prompt_logprobs(self, next_tokens: np.ndarray):
        with jax.set_mesh(self.mesh):
            return self.programs.call("prompt_logprobs", self._prompt_logprobs,
                                      (self.state, self._last_hidden, next_tokens, *self._last_head))

    # ---- host-side metadata ----------------------------------------------------------

    def slot_mapping(self, blocks: list[int], positions: np.ndarray) -> np.ndarray:  # i32[n]
        """The cache slots of a sequence's tokens at `positions`, given its blocks."""
        bs = self.block_size
        return (np.asarray(blocks, np.int32)[positions // bs] * bs + positions % bs).astype(np.int32)

    @property
    def no_slot(self) -> int:
        """A slot past the cache: padding tokens write nowhere."""
        return self.num_blocks * self.block_size

    def prefill_metadata(self, slot_mapping: np.ndarray, token_seq: np.ndarray) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=slot_mapping, token_seq=token_seq, mode="prefill",
                                 platform=self.attention_platform, interpret=self.interpret)

    def paged_metadata(self, slot_mapping: np.ndarray, block_tables: np.ndarray) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, mode="paged",
                                 platform=self.attention_platform, interpret=self.interpret)

    # ---- traced steps ------------------------------------------------------------------

    def _hook(self, pool, lora_info, prefill: bool):
        if pool is None:
            return None
        from lora_runtime.lora.hook import PoolLoRAHook

        return PoolLoRAHook(self.backend, pool, lora_info, prefill=prefill)

    def _forward(self, state, kv_cache, pool, tokens, positions, attn, lora_info, prefill: bool):
        model = nnx.merge(self.graphdef, state)
        hook = self._hook(pool, lora_info, prefill)
        hidden, kv_cache = model(tokens, positions, kv_cache, attn, hook)
        return model, hook, hidden, kv_cache

    def _prefill_impl(self, state, kv_cache, pool, tokens, positions, attn, last_index, lora_info, *, mode):
        del mode  # in the metadata; kept apart so each mode is its own compiled function
        model, hook, hidden, kv_cache = self._forward(state, kv_cache, pool, tokens, positions, attn, lora_info,
                                                      True)
        return self._whole(model.logits(hidden[last_index], hook, last_index)), kv_cache, hidden

    @staticmethod
    def _init_row_impl(counts, seen, row, tokens, prompt_len):
        """Row `row` starts a sequence whose tokens so far are `tokens` (-1 padded): its prompt
        is marked seen and its generated tokens (past `prompt_len`) counted."""
        counts = counts.at[row].set(0)
        valid = tokens >= 0
        safe = jnp.where(valid, tokens, counts.shape[1])  # padding: out of range, dropped
        seen = seen.at[row].set(False).at[row, safe].set(True, mode="drop")
        generated = valid & (jnp.arange(tokens.shape[0]) >= prompt_len)
        counts = counts.at[row, safe].add(generated.astype(counts.dtype), mode="drop")
        return counts, seen

    def _prompt_logprobs_impl(self, state, hidden, next_tokens, pool=None, lora_info=None):
        model = nnx.merge(self.graphdef, state)
        return step_logprobs(model.logits(hidden, self._hook(pool, lora_info, True)), next_tokens)

    def _decode_impl(self, state, kv_cache, pool, sampled, tokens, positions, attn, lora_info):
        tokens = jnp.where(tokens < 0, sampled, tokens)  # token b is batch row b's
        model, hook, hidden, kv_cache = self._forward(state, kv_cache, pool, tokens, positions, attn, lora_info,
                                                      False)
        return self._whole(model.logits(hidden, hook)), kv_cache  # token b of the batch is batch row b

    def _whole(self, logits):
        """Logits whole on every device, as the sampler is compiled for them (a tensor-parallel
        head leaves them split over the vocabulary; the sampler's sort gathers them anyway)."""
        return jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, PartitionSpec()))

    # ---- host calls --------------------------------------------------------------------

    def prefill(self, inputs: StepInputs, pool, host_work: HostWork | None = None) -> Sampled:
        """Runs one packed prefill step of fresh sequences; returns each one's first sampled
        token. `host_work` runs while the forward computes (see HostWork)."""
        return self._run_prefill("prefill", inputs, pool, host_work)

    def extend(self, inputs: StepInputs, pool, host_work: HostWork | None = None) -> Sampled:
        """Runs chunks of sequences over what their blocks already hold (Q groups of C tokens,
        see AttentionMetadata); a sequence's last chunk samples its next token."""
        return self._run_prefill("extend", inputs, pool, host_work)

    def dispatch_prefill(self, inputs: StepInputs, pool, host_work: HostWork | None = None) -> "PendingSample":
        """Starts a packed prefill step (as `prefill`) and returns; the PendingSample's get()
        waits for its first tokens."""
        return self._dispatch_prefill("prefill", inputs, pool, host_work)

    def _run_prefill(self, kind: str, inputs: StepInputs, pool, host_work: HostWork | None) -> Sampled:
        return self._dispatch_prefill(kind, inputs, pool, host_work).get()

    def _dispatch_prefill(self, kind: str, inputs: StepInputs, pool, host_work: HostWork | None) -> "PendingSample":
        self._op("forward", kind, _without_sampling(inputs), pool)
        mask = host_work() if host_work is not None else None
        return self._op("sample", inputs.sampling, inputs.seq_rows, mask)

    def _host_args(self, name: str, host: tuple, compiling: bool) -> tuple:
        """A step's host inputs as its program takes them: the device copies DeviceInputs keeps
        (sent when changed), or their specs when compiling it ahead of time."""
        return self.inputs.specs(host) if compiling else self.inputs.put(name, host)

    def _prefill_args(self, kind: str, inputs: StepInputs, pool, compiling: bool = False) -> tuple:
        host = (inputs.tokens, inputs.positions, inputs.attn, inputs.last_index, inputs.lora)
        return (self.state, self.kv_cache, _pool_for(inputs, pool), *self._host_args(kind, host, compiling))

    def _decode_args(self, inputs: StepInputs, pool, compiling: bool = False) -> tuple:
        host = (inputs.tokens, inputs.positions, inputs.attn, inputs.lora)
        return (self.state, self.kv_cache, _pool_for(inputs, pool), self.decode_tokens,
                *self._host_args("decode", host, compiling))

    def _sample_args(self, logits, sampling: SamplingBatch, seq_rows: np.ndarray, mask: np.ndarray | None,
                     compiling: bool = False, copies: str = "sample") -> tuple:
        host = self._host_args(copies, (sampling, seq_rows, mask), compiling)
        return (logits, self.token_counts, self.prompt_seen, *host)

    # ---- ahead-of-time compilation (warm-up) ----------------------------------------------
    # Each compiles the step the matching call above would run on inputs of this shape, and
    # runs nothing: the call then finds the executable in the program store (or jit's cache).
    # Safe to call from several threads at once (warm-up compiles in parallel).

    def compile_prefill(self, inputs: StepInputs, pool, *, prompt_logprobs: bool = False) -> None:
        """Compiles the packed prefill of `inputs`' shape and, with `prompt_logprobs`, the
        prompt log-probabilities read from its hidden states (in the layout it leaves them)."""
        with jax.set_mesh(self.mesh):
            shardings = self.programs.compile("prefill", self._prefill,
                                              self._prefill_args("prefill", inputs, pool, compiling=True), donate=(1,))
            if prompt_logprobs:
                t, h = inputs.tokens.shape[0], self.model_config.hidden_size
                aval = jax.ShapeDtypeStruct((t, h), self.model_config.dtype, sharding=shardings[-1])
                self.programs.compile("prompt_logprobs", self._prompt_logprobs,
                                      (self.state, aval, np.zeros(t, np.int32), *_head_lora(inputs, pool)))

    def compile_extend(self, inputs: StepInputs, pool) -> None:
        with jax.set_mesh(self.mesh):
            self.programs.compile("extend", self._extend, self._prefill_args("extend", inputs, pool, compiling=True),
                                  donate=(1,))

    def compile_decode(self, inputs: StepInputs, pool) -> None:
        with jax.set_mesh(self.mesh):
            self.programs.compile("decode", self._decode, self._decode_args(inputs, pool, compiling=True),
                                  donate=(1,))

    def compile_sample(self, rows: int, *, masked: bool = False) -> None:
        """Compiles the sampler for steps that sample `rows` rows; `masked`: the variant for
        steps where some row has a grammar."""
        logits = jax.ShapeDtypeStruct((rows, self.model_config.vocab_size), jnp.float32,
                                      sharding=NamedSharding(self.mesh, PartitionSpec()))
        mask = np.full((rows, self.mask_words), -1, np.int32) if masked else None
        with jax.set_mesh(self.mesh):
            self.programs.compile("sample", self._sample, self._sample_args(
                logits, SamplingBatch.from_rows([None] * rows), np.full(rows, -1, np.int32), mask, compiling=True),
                donate=(1,))

    def warm_sample(self, rows: int, *, masked: bool) -> None:
        """Runs the sampler once on zero logits of `rows` idle rows (warm-up)."""
        self._op("idle_logits", rows)
        mask = np.full((rows, self.mask_words), -1, np.int32) if masked else None
        self._op("sample", SamplingBatch.from_rows([None] * rows), np.full(rows, -1, np.int32), mask).get()

    @property
    def mask_words(self) -> int:
        """32-bit words of one row's allowed-token bitmask."""
        return (self.model_config.vocab_size + 31) // 32

    def init_row(self, row: int, tokens: list[int], prompt_len: int) -> None:
        """Sets a batch row's penalty state for a sequence with `tokens` so far (prompt first)."""
        history = np.full(history_bucket(len(tokens)), -1, np.int32)
        history[: len(tokens)] = tokens
        self._op("init_row", row, history, prompt_len)

    def prompt_logprobs(self, next_tokens: np.ndarray) -> Sampled:
        """Log-probabilities at every position of the last prefill: of `next_tokens[t]` (the
        prompt token after position t) and the likeliest tokens there."""
        if self._last_hidden is None:
            raise RuntimeError("prompt_logprobs needs a prefill first")
        return Sampled.from_device(next_tokens, self._op("prompt_logprobs", next_tokens))

    def decode(self, inputs: StepInputs, pool, host_work: HostWork | None = None) -> Sampled:
        """Runs one decode step, a token per batch row; returns a token per row."""
        return self.dispatch_decode(inputs, pool, host_work).get()

    def dispatch_decode(self, inputs: StepInputs, pool, host_work: HostWork | None = None) -> "PendingSample":
        """Starts one decode step on the device, runs `host_work` while its forward computes,
        starts its sampling (with the mask host_work returned) and returns; the
        PendingSample's get() waits for the tokens (one device-to-host transfer)."""
        self._op("forward", "decode", _without_sampling(inputs), pool)
        mask = host_work() if host_work is not None else None
        rows = np.where(inputs.rows >= 0, np.arange(inputs.rows.shape[0], dtype=np.int32), -1).astype(np.int32)
        return self._op("sample", inputs.sampling, rows, mask)


def _sample_impl(logits, counts, seen, sampling, seq_rows, mask=None):
    """Tokens for the logit rows (row i of batch row seq_rows[i], -1: none; allowed tokens:
    row i of `mask`, see apply_token_mask), their log-probabilities, and the counts with
    each row's new token added."""
    n_rows = counts.shape[0]
    row_of = jnp.clip(seq_rows, 0, n_rows - 1)
    adjusted = apply_penalties(logits, counts, seen, sampling, row_of)
    if mask is not None:
        adjusted = apply_token_mask(adjusted, mask)
    tokens = sample(adjusted, sampling)
    count_rows = jnp.where(seq_rows >= 0, seq_rows, n_rows)  # -1 rows fall off the end
    counts = counts.at[count_rows, tokens].add(1, mode="drop")
    # Log-probabilities are the model's own, before penalties (as sampling params leave them).
    return tokens, step_logprobs(logits, tokens, sampling.want_logprobs), counts


def _without_sampling(inputs: StepInputs) -> StepInputs:
    """A step's inputs as its forward takes them (sampling goes to the sample op)."""
    return dataclasses.replace(inputs, sampling=None)


def _head_lora(inputs: StepInputs, pool) -> tuple:
    """(pool, adapter batch) for prompt log-probabilities read from this prefill's hidden states:
    the head's adapters apply when the pool holds lm_head ones (LoRA or saved copies); else (None, None)."""
    from lora_runtime.lora.adapter import HEAD

    if inputs.lora is None or pool is None or not pool.adapts(HEAD):
        return None, None
    return pool, inputs.lora


def _pool_for(inputs: StepInputs, pool):
    """The adapter pool a step reads: none when no token of it uses an adapter, so base
    traffic runs the base model's own program."""
    return pool if inputs.lora is not None else None
