"""Fixtures for LoRA runtime tests: a tiny base model, PEFT adapters and a GCS emulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_runtime.model.config import ModelConfig
from tests.gcs_emulator import run_gcs_emulator
from tests.lora.peft_adapters import make_base_model, make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory) -> Path:
    return make_base_model(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="session")
def model_config(base_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(str(base_dir))


@pytest.fixture(scope="session")
def adapter_dirs(base_dir, tmp_path_factory) -> dict[str, Path]:
    """Named adapters of mixed ranks, alphas and PEFT options."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "r4": dict(r=4, alpha=8, target_modules=ALL, seed=1),
        "r8_rslora": dict(r=8, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True, seed=2),
        "r16_pattern": dict(r=16, alpha=32, target_modules=ALL, seed=3,
                            rank_pattern={"k_proj": 4, "model.layers.1.mlp.up_proj": 8},
                            alpha_pattern={"o_proj": 5}),
        "r8_layer1": dict(r=8, alpha=4, target_modules=["q_proj", "o_proj", "gate_proj", "up_proj"], seed=4,
                          layers_to_transform=[1]),
    }
    return {name: make_peft_adapter(base_dir, root / name, **spec) for name, spec in specs.items()}


@pytest.fixture(scope="session")
def extra_adapter_dirs(base_dir, tmp_path_factory) -> dict[str, Path]:
    """Adapters only a pool with room for DoRA scales, lora_bias shifts and embedding/head adapters serves."""
    root = tmp_path_factory.mktemp("extra_adapters")
    specs = {
        "dora": dict(r=8, alpha=16, target_modules=ALL, use_dora=True, seed=5, rank_pattern={"o_proj": 4}),
        "embed_head": dict(r=4, alpha=8, target_modules=["embed_tokens", "lm_head", "v_proj"], seed=6),
        "dora_head": dict(r=16, alpha=8, target_modules=["lm_head", "gate_proj", "q_proj"], use_dora=True,
                          use_rslora=True, seed=7),
        # PEFT's lora_bias: lora_B has a bias, on column (q, k) and row (down) groups and the head.
        "bias": dict(r=4, alpha=8, target_modules=["q_proj", "k_proj", "down_proj", "lm_head"], lora_bias=True,
                     seed=9, rank_pattern={"k_proj": 2}),
    }
    return {name: make_peft_adapter(base_dir, root / name, **spec) for name, spec in specs.items()}


@pytest.fixture(scope="session")
def gcs():
    with run_gcs_emulator() as emulator:
        yield emulator
