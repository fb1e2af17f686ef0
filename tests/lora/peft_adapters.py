"""Tiny HF Llama base models and random PEFT LoRA adapters built with transformers + PEFT.

Importable from any test folder (`from tests.lora.peft_adapters import ...`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# GQA (8 query heads over 4 kv heads) and every projection width divisible by 4, so
# tensor-parallel tests run with TP=4.
TINY_LLAMA = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def make_base_model(out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """A random f32 LlamaForCausalLM saved as safetensors in `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    # HF's 0.02 init gives near-uniform logits; larger weights make adapter deltas visible.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def load_base_model(base_dir: Path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    return model.float().eval()


def make_peft_adapter(base_dir: Path, out_dir: Path, *, r: int, alpha: float, target_modules,
                      use_rslora: bool = False, seed: int = 0, **lora_kwargs) -> Path:
    """A random PEFT LoRA adapter of the base model in `base_dir`, saved in `out_dir`.

    `init_lora_weights=False` gives random A and B (PEFT's default B is zero, which
    would change nothing); `lora_kwargs` go to LoraConfig (rank_pattern,
    layers_to_transform, ...).
    """
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, use_rslora=use_rslora,
                        init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    torch.manual_seed(seed)
    model = get_peft_model(load_base_model(base_dir), config)
    scale_up_adapter(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def scale_up_adapter(peft_model) -> None:
    """Makes a random PEFT adapter move the logits: nn.Linear's default init makes B small (so
    B is scaled up), DoRA's magnitudes start at the merged weight's norms (so each one is
    scaled by a random factor in [0.5, 1.5], else DoRA would change no more than LoRA), and
    modules_to_save copies start equal to the base module (so noise is added to them)."""
    import torch

    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.mul_(4.0)
            elif "lora_magnitude_vector" in name:
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
            elif "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.1)


def peft_logits(base_dir: Path, adapter_dir: Path | None, ids: list[int]) -> np.ndarray:  # f32[len(ids), V]
    """PEFT's logits for one sequence with the adapter active (or the base model when None)."""
    import torch
    from peft import PeftModel

    model = load_base_model(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config.json, tensors) of an adapter directory."""
    from safetensors.numpy import load_file

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return config, load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))


def write_adapter(out_dir: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """Writes an adapter directory from a config dict and numpy tensors (for hand-made cases)."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def engine_greedy(base_dir: Path, adapter_dirs: dict[str, Path], requests: list[tuple[list[int], str | None]],
                  steps: int) -> list[list[int]]:
    """The engine's greedy tokens for (prompt ids, adapter name or None) requests, all in one
    batch, with `adapter_dirs` registered (one prefill bucket: few programs to compile)."""
    from lora_runtime.engine.config import EngineConfig
    from lora_runtime.engine.engine import Engine
    from lora_runtime.engine.sampling import SamplingParams

    engine = Engine.from_pretrained(str(base_dir), EngineConfig(
        max_batch=len(requests), max_seq_len=32, max_loras_per_batch=max(1, len(adapter_dirs)), max_lora_rank=16,
        max_prefill_tokens=16))
    try:
        for name, path in adapter_dirs.items():
            engine.lora_manager.register(name, str(path))
        engine.start()
        outs = engine.generate_batch([p for p, _ in requests],
                                     SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True),
                                     [a for _, a in requests])
    finally:
        engine.shutdown()
    return [out.token_ids for out in outs]
