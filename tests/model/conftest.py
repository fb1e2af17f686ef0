"""Tiny random Hugging Face checkpoints of each supported family, saved as safetensors."""

from __future__ import annotations

from pathlib import Path

import pytest

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "llama3_rope_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            attention_bias=True,
            rope_theta=500.0,
            # A short original context so the llama3 scaling changes low and medium frequencies.
            rope_scaling=dict(
                rope_type="llama3",
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    # A 4-token window, shorter than the test sequences, so the mask matters.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=4, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=4)),
    # head_dim 32 != hidden / heads, as in real Qwen3 models.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=4, head_dim=32, tie_word_embeddings=True)),
}
TP_FAMILIES = [name for name, (_, _, o) in FAMILIES.items() if o["num_key_value_heads"] == 4]


def build_hf_model(family: str, seed: int = 0, **overrides):
    """A random f32 transformers model of ``family`` (``overrides`` on top of its config) with
    weights large enough to vary outputs."""
    import torch
    import transformers

    config_cls, model_cls, family_overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **family_overrides, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # HF's 0.02 init gives near-uniform logits and fragile argmaxes; these do not.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def save_checkpoint(model, out_dir: Path, **save_kwargs) -> Path:
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    return out_dir


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """family -> (transformers model, checkpoint directory), built once per session."""
    out = {}
    for family in FAMILIES:
        model = build_hf_model(family)
        out[family] = (model, save_checkpoint(model, tmp_path_factory.mktemp(family)))
    return out
