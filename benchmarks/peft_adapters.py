"""Random LoRA adapters for a Hugging Face checkpoint, written by PEFT itself
(`get_peft_model` + `save_pretrained`), so the same files serve both our deployment and the
transformers + PEFT peer."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_peft_adapters(base_dir: str, out_dir: str, names: Sequence[str], *, r: int, alpha: float,
                               seed: int, b_std: float = 0.1) -> dict[str, str]:
    """One PEFT LoRA adapter per name on every attention and MLP projection of the model in
    `base_dir`, rank `r`, seeded: A normal with std 1/sqrt(fan_in), B normal with std `b_std`
    (PEFT starts B at zero, which would leave the adapter a no-op). Returns name -> adapter folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(TARGET_MODULES), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    out = pathlib.Path(out_dir)
    sources = {}
    for name in names:
        with torch.no_grad():
            for param_name, p in peft_model.named_parameters():
                if ".lora_A." in param_name:
                    p.copy_(torch.randn(p.shape, generator=generator) / p.shape[1] ** 0.5)
                elif ".lora_B." in param_name:
                    p.copy_(b_std * torch.randn(p.shape, generator=generator))
        folder = out / name
        peft_model.save_pretrained(str(folder), safe_serialization=True)
        (folder / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template
        sources[name] = str(folder)
    return sources
