"""Application arguments for ``build_app``: every field validated and described."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_REGISTRY_URL = os.path.join("~", ".cache", "multilora-serve", "registry.json")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class AppArgs(BaseModel):
    """Arguments of the serving application (the ``args`` map of serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        "demo",
        description="Base model: an HF checkpoint directory or fsspec URL, or 'demo' for "
        "the shipped demo checkpoint (whose demo adapters are registered at start).",
    )
    model_name: str | None = Field(
        None,
        description="Name clients use for the base model; None takes the checkpoint "
        "directory's name.",
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer folder or fsspec URL (tokenizer.json, tokenizer_config.json, chat "
        "template) to use instead of the checkpoint's; None uses the checkpoint's.",
    )
    num_replicas: int = Field(1, description="LoRAModelServer replicas, one engine each.")
    ingress_replicas: int = Field(
        1, description="OpenAIIngress replicas (HTTP parsing, auth, routing). Serve's proxy spreads requests "
        "over them; with more than one, an IngressLedger replica keeps what they share: each API key's rate "
        "limits, the counts /metrics shows, and where their routers sent which prompt starts and adapters (prefix "
        "affinity, adapter residency and rates).")
    ingress_autoscaling: dict | None = Field(
        None, description="Serve autoscaling of the OpenAIIngress replicas (Serve's autoscaling_config: "
        "min_replicas, max_replicas, target_ongoing_requests, ...), instead of a fixed ingress_replicas. The "
        "replicas share what several ingress replicas share (the IngressLedger) as they come and go.")
    tensor_parallel_size: int = Field(1, description="Devices each replica shards the model over (over all its hosts).")
    hosts_per_replica: int = Field(
        1, description="Hosts (machines) each replica spans, for a model larger than one host: each holds "
        "tensor_parallel_size / hosts_per_replica devices, the replica leads one worker on each other host, and "
        "all join one JAX runtime whose mesh spans every host's devices (deployments/hosts.py). On cpu the hosts "
        "are processes, which may share a node.")
    max_batch: int = Field(
        8, description="Most sequences one replica runs at once (decoded together; vLLM's max_num_seqs). "
        "Their K/V take cache blocks as they grow, so this is not a memory reservation.")
    max_seq_len: int = Field(64, description="Longest prompt plus completion, in tokens (the demo model holds 64).")
    kv_block_size: int | None = Field(
        None, description="Tokens per KV cache block; null: 128 on TPU, else 16.")
    kv_cache_memory_fraction: float = Field(
        0.9, description="Share of each GPU/TPU's memory a replica uses; what weights, adapter pool and step "
        "workspace leave of it becomes KV cache blocks.")
    kv_cache_bytes: int | None = Field(
        None, description="KV cache bytes per device, overriding the fraction; on CPU null sizes the cache "
        "for max_batch sequences of max_seq_len tokens.")
    attention_backend: str = Field(
        "auto", description="Paged attention: auto (Pallas kernels on TPU and GPU, XLA on CPU), xla or pallas.")
    max_prefill_tokens: int | None = Field(
        None,
        description="Most prompt tokens one engine step computes (at least 16), so the longest pause a "
        "prefill puts between decode steps; longer prompts are computed in chunks. None: max_seq_len, at most 2048.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Start a request from a KV cache row already holding the start of its prompt "
        "(same adapter): its prompt tokens there are not recomputed (usage's cached_tokens).",
    )
    prefix_cache_min_tokens: int = Field(
        16, description="Shortest cached prompt prefix worth using; shorter ones are recomputed."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: requests run in arrival order (warm adapters first) and a request's priority "
        "must be 0. priority: lowest priority first, and a waiting request preempts running ones of a higher "
        "value for a batch row or KV blocks (vLLM's priority scheduling).")
    max_loras_per_batch: int = Field(
        4, description="Device adapter slots per replica: the most distinct adapters in one batch, and beyond "
        "max_batch, adapters kept on the devices for the batches to come (each slot's bytes come out of the KV "
        "cache's share of device memory).")
    max_lora_rank: int = Field(
        64, description="Largest adapter rank accepted; each slot is this wide (smaller ranks zero-padded)."
    )
    adapter_memory_fraction: float | None = Field(
        None, description="Size the device adapter slots from memory: as many max_lora_rank slots as fit in this "
        "share of the replica's memory budget (kv_cache_memory_fraction of each device's memory), never fewer than "
        "max_loras_per_batch; the KV cache gets the rest. Fixed at start; the adapter_slots metric shows the "
        "count. On CPU (no memory limit) max_loras_per_batch stands. Null: max_loras_per_batch slots.")
    lora_rank_classes: list[int] | dict[int, float] | None = Field(
        None, description="Rank-aware slots, e.g. [8, 16, 32, 64] (widest = max_lora_rank): the bytes of "
        "max_loras_per_batch padded slots split among the classes (equally, or {rank: share}), each in slots of "
        "its own width; an adapter takes the narrowest class it fits. None: every slot max_lora_rank wide.")
    lora_dora: bool = Field(
        True, description="Serve DoRA adapters (use_dora): each slot holds f32 per-output scales for them.")
    lora_bias: bool = Field(
        True, description="Serve adapters trained with PEFT's lora_bias: each slot holds an f32 shift per output of "
        "its target modules.")
    lora_embedding_modules: bool = Field(
        True, description="Serve adapters of embed_tokens and lm_head: each slot holds rank x vocab rows for each.")
    lora_modules_to_save_max_bytes: int = Field(
        0, ge=0, description="Serve modules_to_save copies of embed_tokens and lm_head up to this many bytes per "
        "adapter (in the served dtype; larger ones are refused with their size); 0 refuses modules_to_save.")
    lora_modules_to_save_slots: int = Field(
        1, ge=1, description="Adapters with modules_to_save copies each replica holds on its devices at once.")
    max_cpu_loras: int = Field(64, description="Adapters kept in each replica's host cache.")
    max_adapter_bytes: int = Field(1 << 30, description="Largest adapter accepted, in bytes.")
    adapter_load_timeout_s: float = Field(
        30.0, gt=0, description="How long requests wait for an adapter being fetched from its storage; past it "
        "they fail with a 503 (adapter_unavailable) while the fetch goes on for later requests.")
    lora_backend: str = Field("auto", description="LoRA backend: auto, reference, xla or pallas.")
    dtype: str | None = Field(None, description="float32, bfloat16, or None for the checkpoint's.")
    stream_interval: int = Field(
        1, ge=1, description="Least new tokens in a streamed chunk after the first (see "
        "EngineConfig.stream_interval).")
    stream_interval_ms: float = Field(
        0.0, ge=0.0, description="Least milliseconds between a streamed request's items after the first "
        "(see EngineConfig.stream_interval_ms); 0: none.")
    async_decode: bool = Field(
        True, description="Dispatch each decode step before the host reads the step before's tokens, so the "
        "host's work of a step runs while the device computes (see EngineConfig.async_decode).")
    generation_config: Literal["auto", "vllm"] = Field(
        "auto", description="Where a request's unset temperature, top_p, top_k, min_p, repetition_penalty and "
        "max_tokens come from: 'auto', the checkpoint's generation_config.json (its creator's recommendation, "
        "as vLLM's default), else the neutral values; 'vllm', the neutral values only (1, 1, off, off, 1, the "
        "context left).")
    scan_layers: bool = Field(
        True, description="Run the layers as one loop over stacked weights, so compile time (a replica's "
        "start) does not grow with depth; False unrolls them (see EngineConfig.scan_layers).")
    compilation_cache_dir: str | None = Field(
        "auto", description="JAX's persistent compilation cache, so a restarted replica reads its compiled "
        "steps instead of compiling them: a directory, 'auto' (JAX_COMPILATION_CACHE_DIR if set, else "
        "multilora/jax-compile under the user's cache directory) or None for none.")
    adapter_roots: list[str] | None = Field(
        None, description="URL prefixes adapters may be registered from; None allows any."
    )
    registry_url: str = Field(
        DEFAULT_REGISTRY_URL,
        description="Where the adapter registry lives: a local path (~ expanded) or an "
        "fsspec URL such as gs://bucket/registry.json. Deployments of different base models "
        "may share one: each serves the entries validated against its own base model.",
    )
    admin_token_env: str = Field(
        "LORA_ADMIN_TOKEN",
        description="Env var holding the admin bearer token; if unset, admin calls are refused.",
    )
    admin_actor_name: str = Field(
        "lora_admin",
        description="Name of the detached admin actor (namespace 'multilora') that owns the registry: "
        "deployments sharing a registry share it; another registry needs another name.",
    )
    max_ongoing_requests: int = Field(
        64, description="Requests Serve sends one model-server replica at a time."
    )
    max_queued_requests: int = Field(
        256, description="Requests each ingress replica holds waiting for a model-server replica (all replicas at "
        "max_ongoing_requests); past it a request is refused at once with a 503 and Retry-After, so overload "
        "costs no memory.")
    max_request_bytes: int = Field(
        8 << 20, description="Largest HTTP request body the endpoint reads; a larger one is refused with a 413 "
        "before it is read whole (by its Content-Length, or as its chunks arrive)."
    )
    api_keys_url: str | None = Field(
        None, description="Keys file (JSON; a local path or fsspec URL) of scoped API keys, stored as SHA-256 "
        "hashes (cluster/api_keys.py): with one, every inference call needs a key, which reaches only the "
        "adapters (and base model) its scope names, at its request and token rates, and admin keys manage "
        "the adapters theirs names. Re-read every api_keys_refresh_s. None: the inference API is open.")
    api_keys_refresh_s: float = Field(
        10.0, description="Seconds between re-reads of the keys file: how soon a new or revoked key takes effect.")
    replica_num_cpus: float = Field(
        1.0, description="CPUs reserved per model-server replica (on each of its hosts when it spans several).")
    replica_num_gpus: float = Field(
        0.0, description="GPUs reserved per model-server replica: 0 (derived from accelerator and "
        "tensor_parallel_size) or tensor_parallel_size; a replica's GPUs are its own.")
    accelerator: str = Field(
        "auto", description="What each model-server replica runs on: cpu (tensor_parallel_size host devices), "
        "gpu (tensor_parallel_size GPUs), tpu (tensor_parallel_size TPU chips), or auto (gpu if "
        "replica_num_gpus asks, else tpu, else gpu if the cluster has them, else cpu). A replica refuses to "
        "start unless JAX sees exactly those devices.")
    accelerator_type: str | None = Field(
        None, description="Ray accelerator type the replicas need (e.g. TPU-V5LITEPOD, TPU-V6E, H100), "
        "so they land on nodes of that kind; None: any.")
    autoscaling: dict | None = Field(
        None, description="Serve autoscaling of the model-server replicas (Serve's autoscaling_config: "
        "min_replicas, max_replicas, target_ongoing_requests, upscale_delay_s, downscale_delay_s, ...), "
        "instead of a fixed num_replicas. None: num_replicas replicas.")
    drain_timeout_s: float = Field(
        20.0, description="Seconds a stopping replica lets running sequences finish."
    )
    # --- routing (cluster/serve_router.py) ---
    adapter_affinity_routing: bool = Field(
        True,
        description="Send each adapter to a replica holding it, else to its rendezvous-hash "
        "home, within a load bound; False uses Serve's multiplex routing.",
    )
    routing_load_slack: float = Field(
        0.25,
        description="Affinity routing: a replica takes an adapter's request while its load is "
        "under max(ceil((1 + slack) x mean load), ceil(mean) + 1), the mean counting that request.",
    )
    routing_hot_rate: float = Field(
        20.0, description="Affinity routing: requests/s above which an adapter gets another home replica."
    )
    routing_max_homes: int = Field(2, description="Affinity routing: most home replicas one hot adapter gets.")
    routing_rate_half_life_s: float = Field(
        10.0, description="Affinity routing: half-life of the per-adapter request rate estimate."
    )

    @field_validator(
        "num_replicas", "ingress_replicas", "tensor_parallel_size", "hosts_per_replica", "max_batch", "max_lora_rank",
        "max_cpu_loras", "max_adapter_bytes", "max_ongoing_requests", "routing_max_homes", "max_request_bytes",
        "max_queued_requests",
        "prefix_cache_min_tokens",
    )
    @classmethod
    def _positive(cls, v: int, info) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name}={v} must be >= 1")
        return v

    @field_validator("max_seq_len")
    @classmethod
    def _seq_len(cls, v: int) -> int:
        if v < 8:
            raise ValueError(f"max_seq_len={v} must be >= 8")
        return v

    @field_validator("max_prefill_tokens")
    @classmethod
    def _prefill_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 16:
            raise ValueError(f"max_prefill_tokens={v} must be >= 16 (the smallest prefill bucket) or null")
        return v

    @field_validator("max_loras_per_batch")
    @classmethod
    def _slots(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"max_loras_per_batch={v} must be >= 0 (0 disables adapters)")
        return v

    @field_validator("kv_block_size", "kv_cache_bytes")
    @classmethod
    def _positive_or_null(cls, v: int | None, info) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"{info.field_name}={v} must be >= 1 or null")
        return v

    @field_validator("kv_cache_memory_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction={v} must be in (0, 1]")
        return v

    @field_validator("adapter_memory_fraction")
    @classmethod
    def _adapter_fraction(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v < 1.0:
            raise ValueError(f"adapter_memory_fraction={v} must be in (0, 1) or null")
        return v

    @field_validator("attention_backend")
    @classmethod
    def _attention(cls, v: str) -> str:
        if v not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention_backend={v!r} must be auto, xla or pallas")
        return v

    @field_validator("routing_hot_rate", "routing_rate_half_life_s", "api_keys_refresh_s")
    @classmethod
    def _strictly_positive(cls, v: float, info) -> float:
        if not v > 0:
            raise ValueError(f"{info.field_name}={v} must be > 0")
        return v

    @field_validator("replica_num_cpus", "replica_num_gpus", "drain_timeout_s", "routing_load_slack")
    @classmethod
    def _non_negative(cls, v: float, info) -> float:
        if v < 0:
            raise ValueError(f"{info.field_name}={v} must be >= 0")
        return v

    @field_validator("api_keys_url")
    @classmethod
    def _keys_url(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("api_keys_url='' must be a path or URL, or null for no API keys")
        return v

    @field_validator("model", "registry_url", "admin_actor_name")
    @classmethod
    def _non_empty(cls, v: str, info) -> str:
        if not v.strip():
            raise ValueError(f"{info.field_name}={v!r} must not be empty")
        return v

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError(f"model_name={v!r} must not be empty")
        return v

    @field_validator("lora_backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v not in ("auto", "reference", "xla", "pallas"):
            raise ValueError(f"lora_backend={v!r} must be auto, reference, xla or pallas")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype={v!r} must be float32, bfloat16 or null")
        return v

    @field_validator("admin_token_env")
    @classmethod
    def _env_name(cls, v: str) -> str:
        if not _ENV_NAME.match(v):
            raise ValueError(f"admin_token_env={v!r} is not an environment variable name")
        return v

    @field_validator("adapter_roots")
    @classmethod
    def _roots(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not r.strip() for r in v):
            raise ValueError(f"adapter_roots={v!r} must not contain empty prefixes")
        return v

    @field_validator("accelerator")
    @classmethod
    def _accelerator(cls, v: str) -> str:
        from deployments.placement import ACCELERATORS

        if v not in ACCELERATORS:
            raise ValueError(f"accelerator={v!r} must be one of {list(ACCELERATORS)}")
        return v

    @field_validator("autoscaling", "ingress_autoscaling")
    @classmethod
    def _autoscaling(cls, v: dict | None, info) -> dict | None:
        if v is None:
            return v
        from ray.serve.config import AutoscalingConfig

        known = getattr(AutoscalingConfig, "model_fields", None) or AutoscalingConfig.__fields__
        unknown = sorted(set(v) - set(known))
        if unknown:
            raise ValueError(f"{info.field_name} has unknown fields {unknown}; Serve's are {sorted(known)}")
        AutoscalingConfig(**v)  # Serve's own checks: names the bad field
        return v

    @model_validator(mode="after")
    def _check(self) -> "AppArgs":
        if self.ingress_autoscaling is not None and self.ingress_replicas != 1:
            raise ValueError(f"ingress_replicas={self.ingress_replicas} with ingress_autoscaling: give one or the "
                             "other (autoscaling sets the number of ingress replicas)")
        self.placement(None)  # contradictions refused at deploy time (auto never contradicts the cluster)
        if self.lora_rank_classes is not None or self.adapter_memory_fraction is not None:
            from pydantic import ValidationError

            try:
                self.engine_config()  # the engine's own checks of the classes, at deploy time
            except ValidationError as err:
                reasons = (str(e.get("ctx", {}).get("error", e["msg"])) for e in err.errors())
                raise ValueError("; ".join(reasons)) from None
        return self

    @property
    def shared_ingress(self) -> bool:
        """Whether there may be more than one ingress replica (then they share an IngressLedger)."""
        if self.ingress_autoscaling is None:
            return self.ingress_replicas > 1
        from ray.serve.config import AutoscalingConfig

        return AutoscalingConfig(**self.ingress_autoscaling).max_replicas > 1

    @property
    def is_demo(self) -> bool:
        return self.model == "demo"

    def placement(self, cluster_resources: dict | None):
        """Each model-server replica's Placement (deployments/placement.py); ``auto`` is
        resolved against ``cluster_resources`` (ray.cluster_resources(), None: unknown)."""
        from deployments.placement import resolve

        return resolve(self.accelerator, self.tensor_parallel_size, num_cpus=self.replica_num_cpus,
                       num_gpus=self.replica_num_gpus, accelerator_type=self.accelerator_type,
                       cluster_resources=cluster_resources, hosts=self.hosts_per_replica)

    def engine_config(self):
        """The replica engine's EngineConfig for these arguments."""
        from lora_runtime.engine.config import EngineConfig

        return EngineConfig(
            max_batch=self.max_batch,
            max_seq_len=self.max_seq_len,
            kv_block_size=self.kv_block_size,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            kv_cache_bytes=self.kv_cache_bytes,
            attention_backend=self.attention_backend,
            max_prefill_tokens=self.max_prefill_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_cache_min_tokens=self.prefix_cache_min_tokens,
            max_loras_per_batch=self.max_loras_per_batch,
            max_lora_rank=self.max_lora_rank,
            adapter_memory_fraction=self.adapter_memory_fraction,
            lora_rank_classes=self.lora_rank_classes,
            lora_dora=self.lora_dora,
            lora_bias=self.lora_bias,
            lora_embedding_modules=self.lora_embedding_modules,
            lora_modules_to_save_max_bytes=self.lora_modules_to_save_max_bytes,
            lora_modules_to_save_slots=self.lora_modules_to_save_slots,
            max_cpu_loras=self.max_cpu_loras,
            lora_backend=self.lora_backend,
            tensor_parallel_size=self.tensor_parallel_size,
            dtype=self.dtype,
            adapter_roots=self.source_roots,
            max_adapter_bytes=self.max_adapter_bytes,
            adapter_load_timeout_s=self.adapter_load_timeout_s,
            compilation_cache_dir=self.compilation_cache_dir,
            scan_layers=self.scan_layers,
            stream_interval=self.stream_interval,
            stream_interval_ms=self.stream_interval_ms,
            async_decode=self.async_decode,
            scheduling_policy=self.scheduling_policy,
        )

    def adapter_validator(self):
        """The AdapterValidator for these arguments: this base model, these limits."""
        from cluster.admin import AdapterValidator

        return AdapterValidator(self.model, self.max_lora_rank, self.source_roots, self.max_adapter_bytes,
                                base_name=self.served_model_name, lora_dora=self.lora_dora, lora_bias=self.lora_bias,
                                lora_embedding_modules=self.lora_embedding_modules,
                                modules_to_save_max_bytes=self.lora_modules_to_save_max_bytes, dtype=self.dtype)

    @property
    def served_model_name(self) -> str:
        """The base model's name for clients: model_name, else the checkpoint folder's name
        (of the path or URL as given, not of a local cached copy)."""
        if self.model_name is not None:
            return self.model_name
        return "demo" if self.is_demo else os.path.basename(self.model.rstrip("/"))

    @property
    def source_roots(self) -> list[str] | None:
        """Where adapters may be read from: ``adapter_roots`` and the folder the admin actor
        writes merged adapters to (None: anywhere)."""
        if self.adapter_roots is None:
            return None
        from cluster.registry_store import merged_store_url

        return [*self.adapter_roots, merged_store_url(self.resolved_registry_url)]

    @property
    def resolved_registry_url(self) -> str:
        if "://" in self.registry_url:
            return self.registry_url
        return os.path.abspath(os.path.expanduser(self.registry_url))

