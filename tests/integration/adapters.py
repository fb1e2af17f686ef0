"""PEFT LoRA adapters made in tests with real PEFT, saved as PEFT saves them."""

from __future__ import annotations

from pathlib import Path


def save_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    **lora_kwargs,
) -> Path:
    """A random (non-zero B) LoRA adapter for the HF checkpoint at ``base_dir``; `lora_kwargs`
    go to LoraConfig (use_dora=True, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, lora_dropout=0.0,
        **lora_kwargs,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        # Larger than PEFT's init so the adapter visibly changes greedy outputs.
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:  # DoRA: around the merged weight's norms
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
            elif "modules_to_save" in name:  # a trained copy of a whole module: the base one moved
                p.add_(torch.randn_like(p) * 0.1)
            elif "lora_" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
