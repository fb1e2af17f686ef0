"""Engine configuration: the limits that fix every compiled shape of a replica."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


# The default step budget: prefill attention scores grow with its square, so a long
# max_seq_len does not make one step compute a whole long prompt at once.
DEFAULT_PREFILL_TOKENS = 2048
ATTENTION_BACKENDS = ("auto", "xla", "pallas")


class EngineConfig(BaseModel):
    """Static limits of one replica's engine; each one bounds a compiled shape or a cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch: int = Field(
        8, ge=1, description="Most sequences running at once (decoded in one step; vLLM's max_num_seqs). "
        "Their K/V take blocks of the cache as they grow, not a max_seq_len row each.")
    max_seq_len: int = Field(
        512, ge=8, description="Longest prompt plus completion, in tokens (up to the model's positions).")
    kv_block_size: int | None = Field(
        None, ge=1, description="Tokens per KV cache block; None: 128 on TPU (the kernel's tile), else 16.")
    kv_cache_memory_fraction: float = Field(
        0.9, gt=0.0, le=1.0, description="Share of each accelerator's memory limit the replica uses: "
        "what weights, adapter pool and step workspace leave of it becomes KV blocks.")
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="KV cache bytes per device, overriding the fraction; on CPU (no memory "
        "limit to read) None sizes it for max_batch sequences of max_seq_len tokens.")
    attention_backend: str = Field(
        "auto", description="Paged attention: auto (the Pallas kernel on TPU and GPU, XLA on CPU), xla or "
        "pallas.")
    max_prefill_tokens: int | None = Field(
        None,
        ge=16,
        description="Most prompt tokens computed in one engine step (so the longest pause a "
        "prefill puts between two decode steps); None means max_seq_len, at most "
        f"{DEFAULT_PREFILL_TOKENS}. Longer prompts are "
        "computed in chunks of up to this many tokens, between decode steps. Prefill lengths "
        "are bucketed to powers of two from 16 up to this.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Start a request from a KV cache row that already holds the start of its "
        "prompt (for the same adapter): a finished request's row, or a running one's, copied.",
    )
    prefix_cache_min_tokens: int = Field(
        16, ge=1, description="Shortest cached prefix worth using (shorter ones are recomputed)."
    )
    max_loras_per_batch: int = Field(
        4, ge=0, description="Device adapter slots, so distinct adapters in one batch; 0 disables LoRA."
    )
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank a slot can hold.")
    adapter_memory_fraction: float | None = Field(
        None, gt=0.0, lt=1.0, description="Size the device adapter slots from memory: as many slots of "
        "max_lora_rank as fit in this share of the replica's memory budget (kv_cache_memory_fraction of the "
        "device's memory limit), never fewer than max_loras_per_batch; the KV cache gets what is left. The count "
        "is fixed when the engine starts (the memory plan's log line and the adapter_slots metric show it). On "
        "CPU, which reports no memory limit, max_loras_per_batch stands. None: max_loras_per_batch slots.")
    lora_rank_classes: list[int] | dict[int, float] | None = Field(
        None, description="Slot widths of a rank-aware pool, e.g. [8, 16, 32, 64] (the widest is max_lora_rank): "
        "the bytes of max_loras_per_batch slots of max_lora_rank are split among the classes (equally, or by the "
        "shares of a {rank: share} mapping), each in slots of its own rank, and an adapter takes a slot of the "
        "narrowest class it fits, so low-rank adapters do not pay for padding. None: every slot max_lora_rank wide.")
    lora_dora: bool = Field(
        True, description="Slots hold DoRA's per-output scales (f32, one per output of every target module), so "
        "DoRA adapters (use_dora) are served; off saves that memory and refuses them.")
    lora_bias: bool = Field(
        True, description="Slots hold the per-output shift of adapters trained with PEFT's lora_bias (f32, one per "
        "output of every target module but the embedding), so they are served; off saves that memory and refuses "
        "them.")
    lora_embedding_modules: bool = Field(
        True, description="Slots hold embed_tokens and lm_head adapters (rank x vocab each); off saves that "
        "memory and refuses adapters that target them.")
    lora_modules_to_save_max_bytes: int = Field(
        0, ge=0, description="Largest modules_to_save copy (a trained embed_tokens and/or lm_head, vocab x hidden "
        "each) one adapter may bring, in bytes of the served dtype; adapters over it are refused with their size. "
        "When one module fits, lora_modules_to_save_slots copies of each of the two are held on the device. "
        "0 refuses modules_to_save.")
    lora_modules_to_save_slots: int = Field(
        1, ge=1, description="Adapters with modules_to_save copies the device holds at once (each slot is a whole "
        "embed_tokens and lm_head); one more evicts the least recently used idle one.")
    max_cpu_loras: int = Field(64, ge=1, description="Adapters kept in the host cache.")
    max_cpu_lora_bytes: int = Field(
        2 << 30, ge=1, description="Bytes of adapter weights kept in the host cache."
    )
    lora_backend: str = Field("auto", description="LoRA backend: auto, reference, xla or pallas.")
    tensor_parallel_size: int = Field(1, ge=1, description="Devices the model is sharded over.")
    dtype: str | None = Field(
        None, description="float32 or bfloat16; None takes the checkpoint's dtype."
    )
    adapter_roots: list[str] | None = Field(
        None, description="URL prefixes adapters may be loaded from; None allows any."
    )
    max_adapter_bytes: int = Field(1 << 30, ge=1, description="Largest adapter accepted, in bytes.")
    adapter_load_timeout_s: float = Field(
        30.0, gt=0, description="How long requests wait for an adapter being fetched from its storage; past it "
        "they fail with a 503 (adapter_unavailable) while the fetch goes on for later requests.")
    scan_layers: bool = Field(
        True, description="Run the layers as one loop over weights stacked per parameter, so a step's "
        "compile time does not grow with depth (a 32-layer model compiles like a 4-layer one). False "
        "unrolls them over per-layer weights: on CPU, where XLA copies a layer's weights out of the stack "
        "inside the loop, a decode step that reads mostly weights is faster unrolled.")
    compilation_cache_dir: str | None = Field(
        "auto", description="JAX's persistent compilation cache, so a restarted replica loads its "
        "compiled steps instead of compiling them: a directory, 'auto' (JAX_COMPILATION_CACHE_DIR if set, "
        "else multilora/jax-compile under the user's cache directory) or None/'' for none.")
    compilation_cache_min_compile_s: float | None = Field(
        None, ge=0.0, description="Only executables that took this long to compile are cached; None: "
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS where set, else every one (so a restart compiles "
        "nothing the warm-up compiled).")
    stream_interval: int = Field(
        1, ge=1, description="Least new tokens in a stream item after the first (the first token goes "
        "at once, and an item that finishes the request goes at once): a larger interval sends fewer, "
        "larger items, which costs the serving path less per token at the cost of a burstier stream.")
    stream_interval_ms: float = Field(
        0.0, ge=0.0, description="Least milliseconds between a request's stream items after the first: "
        "an item waits until then, gathering every token that comes meanwhile (the first token goes at "
        "once, and so does an item that finishes the request, so neither the time to the first token nor "
        "to the last changes). 0: no wait. With stream_interval, an item waits for both.")
    async_decode: bool = Field(
        True, description="Dispatch each decode step before the tokens of the step before reach the host "
        "(each row reads its last token on the device), so the host's work of a step (settling tokens, "
        "text, stream items, the next step's inputs) runs while the device computes the next one; a packed "
        "prefill joining decoding rows is dispatched behind the decode step in flight and its first tokens "
        "read once the next decode step is dispatched behind it (its rows decode from the step after). A "
        "sequence that ends on a token computes one more step, which is dropped. Rows with a grammar or "
        "bad_words wait for their tokens. False: each step's tokens are read before the next is built.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: requests are admitted in arrival order (warm adapters first) and a "
        "request's priority must be 0. priority: the most urgent (lowest) priority first, and a waiting "
        "request preempts running ones of a less urgent priority for a batch row or KV blocks.")
    max_wait_steps: int = Field(
        32,
        ge=1,
        description="Steps a waiting request may be passed over before it goes first: nothing is admitted "
        "ahead of it, and the rest join once it is in. While it waits for its adapter (a slot, or the "
        "adapter's bytes), requests that take no new slot keep joining and the held slot that frees first "
        "drains (no new request joins it).",
    )

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or None")
        shares = self.rank_class_shares()
        if shares is not None:
            bad = {r: v for r, v in shares.items() if r <= 0 or v <= 0}
            if bad:
                raise ValueError(f"lora_rank_classes {bad}: every rank and share must be positive")
            if max(shares) != self.max_lora_rank:
                raise ValueError(f"lora_rank_classes {sorted(shares)}: the widest class must be "
                                 f"max_lora_rank={self.max_lora_rank}")
            ranks = self.lora_rank_classes
            if isinstance(ranks, list) and len(set(ranks)) != len(ranks):
                raise ValueError(f"lora_rank_classes {self.lora_rank_classes} repeats a rank")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")
        if self.adapter_memory_fraction is not None and self.max_loras_per_batch == 0:
            raise ValueError(f"adapter_memory_fraction={self.adapter_memory_fraction} sizes the adapter slots, but "
                             f"max_loras_per_batch=0 turns adapters off; set max_loras_per_batch to the fewest "
                             f"slots (at least 1)")
        return self

    def rank_class_shares(self) -> dict[int, float] | None:
        """{rank: share of the pool bytes} of lora_rank_classes (a list shares equally)."""
        spec = self.lora_rank_classes
        if not spec:
            return None
        if isinstance(spec, dict):
            return {int(r): float(v) for r, v in spec.items()}
        return {int(r): 1.0 for r in spec}

    @property
    def prefill_budget(self) -> int:
        return self.max_prefill_tokens or min(self.max_seq_len, DEFAULT_PREFILL_TOKENS)

    def block_size(self, platform: str) -> int:
        """Tokens per KV block on `platform` ("cpu", "gpu" or "tpu")."""
        return self.kv_block_size or (128 if platform == "tpu" else 16)

    def attention_platform(self, platform: str) -> str:
        """The paged-attention formulation (kernels/paged_attention) for `platform`: auto takes the
        machine's kernel on an accelerator, XLA's on CPU. (On TPU any head_dim: the cache pads
        heads to whole lane tiles, kernels.common.page_head_dim.)"""
        if self.attention_backend == "xla" or (self.attention_backend == "auto" and platform == "cpu"):
            return "xla"
        if platform == "cpu":
            raise ValueError("attention_backend='pallas' needs a GPU or TPU (on CPU: auto or xla)")
        return platform

    def compilation_cache_path(self) -> str | None:
        """The persistent compilation cache directory this config asks for (None: none)."""
        if self.compilation_cache_dir == "auto":
            from lora_runtime.engine.compile_events import default_cache_dir

            return default_cache_dir()
        return self.compilation_cache_dir or None

    def prefill_buckets(self) -> tuple[int, ...]:
        """Token counts a prefill step is padded to: powers of two from 16, capped."""
        buckets, n = [], 16
        while n < self.prefill_budget:
            buckets.append(n)
            n *= 2
        buckets.append(self.prefill_budget)
        return tuple(buckets)
