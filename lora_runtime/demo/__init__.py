"""The shipped demo: a small trained base model and one LoRA adapter per word task.

Only paths live here (no torch): the serving side finds the files through them.
``lora_runtime.demo.train`` recreates the files; ``lora_runtime.demo.tasks`` says what
each adapter does and the prompt format ("hello=" -> "olleh" with the reverse adapter).
"""

from __future__ import annotations

from pathlib import Path

from lora_runtime.demo.tasks import ADAPTER_TASKS

ASSETS_DIR = Path(__file__).parent / "assets"
BASE_MODEL_DIR = ASSETS_DIR / "base"  # config.json, model.safetensors, tokenizer files
ADAPTERS_DIR = ASSETS_DIR / "adapters"  # <task>/adapter_config.json, adapter_model.safetensors
# The demo model's vocabulary: a multiple of 128 (TPU lanes) that also splits over 2, 4 or 8
# tensor-parallel devices; ids past the tokenizer's 259 are never produced by it. Here, not in
# train.py, so code without torch can size a model for the demo tokenizer.
MODEL_VOCAB_SIZE = 384


def adapter_dir(name: str) -> Path:
    """The folder of the demo adapter for task ``name`` (one of ADAPTER_TASKS)."""
    if name not in ADAPTER_TASKS:
        raise ValueError(f"{name=} is not a demo adapter; choose one of {sorted(ADAPTER_TASKS)}")
    return ADAPTERS_DIR / name


def demo_model_dir() -> str:
    """The base model's folder, as the string Engine.from_pretrained takes."""
    return str(BASE_MODEL_DIR)


def demo_adapters() -> dict[str, Path]:
    """Every demo adapter's folder by task name (reverse, upper, sort, caesar)."""
    return {name: adapter_dir(name) for name in ADAPTER_TASKS}
