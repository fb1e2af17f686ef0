"""The base model's shape and numerics, parsed from a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from lora_runtime.errors import CheckpointError
from lora_runtime.model.activations import ACTIVATIONS

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
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of a checkpoint, resolved as transformers resolves it.

    "linear": positions divided by ``factor``. "llama3": Llama 3.1 long context. "yarn":
    frequencies blended between extrapolated and interpolated by a ramp from ``beta_fast``
    to ``beta_slow`` rotations over ``original_max_position_embeddings``, with cos and sin
    multiplied by ``attention_factor``. "dynamic" (dynamic NTK): plain RoPE, which is what
    transformers computes for sequences up to ``original_max_position_embeddings``; past it
    transformers recomputes the frequencies for the whole sequence, which a KV cache cannot
    reproduce, so an engine may not run longer sequences (``ModelConfig.check_max_seq_len``).
    """

    rope_type: str  # "linear" | "llama3" | "yarn" | "dynamic"
    factor: float
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    # llama3, yarn: the pretraining context; dynamic: the longest sequence with plain RoPE
    original_max_position_embeddings: int | None = None
    attention_factor: float = 1.0  # yarn: multiplies cos and sin
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    truncate: bool | None = None  # yarn: round the ramp's ends to whole dimensions

    @classmethod
    def from_hf_dict(
        cls,
        d: dict[str, Any] | None,
        *,
        max_position_embeddings: int,
        original_max_position_embeddings: int | None = None,
    ) -> RopeScaling | None:
        """Parses HF ``rope_scaling`` / ``rope_parameters``; None for plain RoPE.

        ``max_position_embeddings`` and ``original_max_position_embeddings`` are config.json's
        top-level fields: yarn falls back on them as transformers does (a top-level
        ``original_max_position_embeddings`` wins over the one in ``d``).
        """
        if d is None:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type in (None, "default"):
            return None
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"unsupported rope_scaling {rope_type=}; supported: {', '.join(ROPE_TYPES)}")
        if "factor" not in d:
            raise CheckpointError(f"rope_scaling of {rope_type=} is missing field 'factor'")
        if rope_type == "yarn":
            return cls._yarn(d, max_position_embeddings, original_max_position_embeddings)
        factor = _positive(d["factor"], "factor", rope_type)
        if rope_type == "linear":
            return cls(rope_type="linear", factor=factor)
        if rope_type == "dynamic":
            # transformers' dynamic NTK keeps plain RoPE up to max_position_embeddings and
            # ignores any original_max_position_embeddings in the dict.
            return cls(
                rope_type="dynamic", factor=factor, original_max_position_embeddings=max_position_embeddings
            )
        missing = [f for f in _LLAMA3_FIELDS if d.get(f) is None]
        if missing:
            raise CheckpointError(f"rope_scaling of {rope_type=} is missing field {missing[0]!r}")
        return cls(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=float(d["low_freq_factor"]),
            high_freq_factor=float(d["high_freq_factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        )

    @classmethod
    def _yarn(cls, d: dict[str, Any], max_position_embeddings: int, top_level_original: int | None) -> RopeScaling:
        """transformers' ``_compute_yarn_parameters``, down to its fallbacks and truthiness tests."""
        key = "original_max_position_embeddings"
        original = top_level_original if top_level_original is not None else d.get(key)
        if original is None:
            original = max_position_embeddings
        elif not _positive(original, key, "yarn").is_integer():
            raise CheckpointError(f"rope_scaling of rope_type='yarn' needs an integer {key}, got {original!r}")
        original = int(original)
        # DeepSeek-V3 style: a null factor is the ratio of the extended to the original context.
        if d["factor"] is None:
            factor = max_position_embeddings / original
        else:
            factor = _positive(d["factor"], "factor", "yarn")
        if d.get("attention_factor") is not None:
            attention_factor = _positive(d["attention_factor"], "attention_factor", "yarn")
        else:
            mscale = _number(d.get("mscale"), "mscale", "yarn")
            mscale_all_dim = _number(d.get("mscale_all_dim"), "mscale_all_dim", "yarn")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor, 1.0)
        return cls(
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=attention_factor,
            # A 0 or null beta takes the default, as transformers' `or` does.
            beta_fast=_number(d.get("beta_fast"), "beta_fast", "yarn") or 32.0,
            beta_slow=_number(d.get("beta_slow"), "beta_slow", "yarn") or 1.0,
            truncate=bool(d.get("truncate", True)),
        )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(value: Any, key: str, rope_type: str) -> float | None:
    """A rope_scaling field as a float, None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"rope_scaling of {rope_type=} needs a number for {key}, got {value!r}")
    return float(value)


def _positive(value: Any, key: str, rope_type: str) -> float:
    number = _number(value, key, rope_type)
    if number is None or not number > 0:
        raise CheckpointError(f"rope_scaling of {rope_type=} needs a positive number for {key}, got {value!r}")
    return number


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
    # Copies of each checkpoint kv head the model holds (for_tensor_parallel): num_kv_heads
    # counts them all, so every device of a mesh wider than the checkpoint's kv heads has one.
    kv_head_copies: int = 1
    hidden_act: str = "silu"  # the gate's activation in the feed-forward (model/activations.py)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise CheckpointError(f"unsupported hidden_act={self.hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
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

    @property
    def checkpoint_kv_heads(self) -> int:
        """The kv heads the checkpoint (and its adapters) hold."""
        return self.num_kv_heads // self.kv_head_copies

    def for_tensor_parallel(self, tp: int) -> ModelConfig:
        """This model as a mesh of `tp` devices serves it: as it is where tp divides its kv
        heads, else with each kv head copied tp / kv_heads times (one per device, as vLLM
        does), which computes the same attention."""
        kv = self.checkpoint_kv_heads
        if self.num_heads % tp:
            raise CheckpointError(f"tensor_parallel_size={tp} does not divide num_attention_heads={self.num_heads}")
        if kv % tp == 0:
            return dataclasses.replace(self, num_kv_heads=kv, kv_head_copies=1)
        if tp % kv:
            raise CheckpointError(
                f"tensor_parallel_size={tp} neither divides num_key_value_heads={kv} nor is a multiple of it: "
                "each device holds a whole number of kv heads (or one copy of one)")
        return dataclasses.replace(self, num_kv_heads=tp, kv_head_copies=tp // kv)

    def kv_rows(self) -> np.ndarray:
        """For each k/v projection output the model holds (i32[num_kv_heads * head_dim]), the
        checkpoint's output it copies."""
        rows = np.arange(self.num_kv_heads * self.head_dim)
        head, dim = rows // self.head_dim, rows % self.head_dim
        return ((head // self.kv_head_copies) * self.head_dim + dim).astype(np.int32)

    def check_max_seq_len(self, max_seq_len: int) -> None:
        """Refuses sequences longer than this model's RoPE can be computed for ahead of time."""
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type != "dynamic":
            return
        limit = scaling.original_max_position_embeddings
        if max_seq_len > limit:
            raise CheckpointError(
                f"rope_scaling of rope_type='dynamic' recomputes RoPE for the whole sequence once it grows past "
                f"max_position_embeddings={limit}, which a KV cache cannot reproduce; "
                f"{max_seq_len=} must be at most {limit}"
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

        quantization = d.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise CheckpointError(f"config.json has quantization_config (quant_method={method!r}): quantized "
                                  "checkpoints are not supported; serve the unquantized (float32, bfloat16 or "
                                  "float16) weights")
        hidden_size = int(req("hidden_size"))
        num_heads = int(req("num_attention_heads"))
        num_layers = int(req("num_hidden_layers"))
        max_position_embeddings = int(req("max_position_embeddings"))
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
            rope_scaling=RopeScaling.from_hf_dict(
                rope,
                max_position_embeddings=max_position_embeddings,
                original_max_position_embeddings=d.get("original_max_position_embeddings"),
            ),
            max_position_embeddings=max_position_embeddings,
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
            hidden_act=str(d.get("hidden_act") or "silu"),
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
