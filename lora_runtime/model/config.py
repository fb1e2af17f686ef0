"""The base model's shape and numerics, parsed from a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from lora_runtime.errors import CheckpointError

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
# Half-precision checkpoints run in bfloat16: same width, and f16's range overflows in
# long residual streams.
_HF_DTYPES: dict[str, str] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "llama3" (Llama 3.1 long context) or "linear" (factor only)."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any] | None) -> RopeScaling | None:
        """Parses HF ``rope_scaling`` / ``rope_parameters``; None for plain RoPE."""
        if d is None:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type in (None, "default"):
            return None
        if rope_type not in ("llama3", "linear"):
            raise CheckpointError(f"unsupported rope_scaling {rope_type=}; supported: default, linear, llama3")
        if "factor" not in d:
            raise CheckpointError(f"rope_scaling of {rope_type=} is missing field 'factor'")
        if rope_type == "linear":
            return cls(rope_type="linear", factor=float(d["factor"]))
        missing = [f for f in _LLAMA3_FIELDS if d.get(f) is None]
        if missing:
            raise CheckpointError(f"rope_scaling of {rope_type=} is missing field {missing[0]!r}")
        return cls(
            rope_type="llama3",
            factor=float(d["factor"]),
            low_freq_factor=float(d["low_freq_factor"]),
            high_freq_factor=float(d["high_freq_factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the JAX model, loader and KV cache need to know about a base model."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v bias
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE
    sliding_window: int | None  # window in tokens, self included; None: full attention
    dtype: str  # "float32" | "bfloat16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_out_bias: bool = False  # o_proj bias (llama/qwen3 attention_bias)
    mlp_bias: bool = False  # gate/up/down bias (llama mlp_bias)
    # Per layer, whether sliding_window applies; None: every layer (when a window is set).
    sliding_layers: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CheckpointError(f"unsupported dtype={self.dtype!r}; supported: {DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise CheckpointError(
                f"layer_types has {len(self.sliding_layers)} entries, expected num_hidden_layers={self.num_layers}"
            )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer, or None for full attention."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, dtype: str | None = None) -> ModelConfig:
        """Parses a Hugging Face config.json dict; ``dtype`` overrides the checkpoint's."""
        architecture = _architecture(d)

        def req(key: str) -> Any:
            if d.get(key) is None:
                raise CheckpointError(f"config.json is missing required field {key!r}")
            return d[key]

        hidden_size = int(req("hidden_size"))
        num_heads = int(req("num_attention_heads"))
        num_layers = int(req("num_hidden_layers"))
        rope = d.get("rope_parameters")
        if rope is None:
            rope = d.get("rope_scaling")
            rope_theta = float(d.get("rope_theta", 10000.0))
        else:
            rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        sliding_window, sliding_layers = _sliding(d, architecture, num_layers)
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(req("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(req("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_hf_dict(rope),
            max_position_embeddings=int(req("max_position_embeddings")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=architecture == "qwen2" or attention_bias,
            qk_norm=architecture == "qwen3",
            sliding_window=sliding_window,
            dtype=_dtype(d, dtype),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            attention_out_bias=architecture in ("llama", "qwen3") and attention_bias,
            mlp_bias=architecture == "llama" and bool(d.get("mlp_bias", False)),
            sliding_layers=sliding_layers,
        )

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str | None = None) -> ModelConfig:
        """Reads ``config.json`` from a checkpoint directory."""
        config_path = os.path.join(path, "config.json")
        try:
            with open(config_path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint has no config.json: {config_path!r} not found") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_path!r} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d, dtype=dtype)


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        for arch in archs:
            if arch in ARCHITECTURES:
                return ARCHITECTURES[arch]
        raise CheckpointError(f"unsupported architectures={archs!r}; supported: {sorted(ARCHITECTURES)}")
    model_type = d.get("model_type")
    if model_type is None:
        raise CheckpointError("config.json is missing required field 'architectures' (and 'model_type')")
    if model_type not in ARCHITECTURES.values():
        raise CheckpointError(f"unsupported {model_type=}; supported: {sorted(ARCHITECTURES.values())}")
    return model_type


def _dtype(d: dict[str, Any], override: str | None) -> str:
    if override is not None:
        if override not in DTYPES:
            raise CheckpointError(f"unsupported dtype={override!r}; supported: {DTYPES}")
        return override
    hf = d.get("dtype") or d.get("torch_dtype") or "float32"
    if hf not in _HF_DTYPES:
        raise CheckpointError(f"unsupported torch_dtype={hf!r} in config.json; supported: {sorted(_HF_DTYPES)}")
    return _HF_DTYPES[hf]


def _sliding(
    d: dict[str, Any], architecture: str, num_layers: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    """The sliding window and which layers use it, as transformers decides them."""
    window = d.get("sliding_window")
    if architecture == "llama" or window is None:
        return None, None
    if architecture in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        return None, None
    window = int(window)
    layer_types = d.get("layer_types")
    if architecture == "mistral" or (layer_types is None and architecture not in ("qwen2", "qwen3")):
        return window, None
    if layer_types is None:
        first = int(d.get("max_window_layers", num_layers))
        layers = tuple(i >= first for i in range(num_layers))
    else:
        bad = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise CheckpointError(f"unsupported layer_types entry {bad[0]!r}")
        layers = tuple(t == "sliding_attention" for t in layer_types)
    if not any(layers):
        return None, None
    return window, layers
