"""Assembles an engine: mesh, sharded checkpoint, tokenizer, LoRA backend, pool and manager."""

from __future__ import annotations

import os

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.runner import ModelRunner
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from lora_runtime.model.tokenizer import Tokenizer


def build_engine(
    model_path: str, config: EngineConfig, *, model_name: str | None = None, tokenizer_path: str | None = None
) -> Engine:
    """An engine serving the HF checkpoint at `model_path` (not yet started).

    `tokenizer_path`: a folder with tokenizer.json (and its config and chat template) to use
    instead of the checkpoint's own; generation_config.json still comes from the checkpoint.
    """
    # Refused before any weight is read.
    ModelConfig.from_pretrained(model_path, dtype=config.dtype).check_max_seq_len(config.max_seq_len)
    mesh = make_mesh(config.tensor_parallel_size)
    model_config, model = load_model(model_path, mesh, dtype=config.dtype)
    tokenizer = Tokenizer.from_pretrained(tokenizer_path or model_path, generation_config_dir=model_path)
    name = model_name or os.path.basename(os.path.normpath(model_path))
    return assemble_engine(model, model_config, tokenizer, config, mesh, model_name=name)


def assemble_engine(
    model: LlamaModel,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    config: EngineConfig,
    mesh,
    *,
    model_name: str = "base",
) -> Engine:
    """An engine around an already-built model (tests and benchmarks use random weights)."""
    model_config.check_max_seq_len(config.max_seq_len)
    backend = manager = None
    if config.max_loras_per_batch > 0:
        from lora_runtime.lora.backend.select import select_backend
        from lora_runtime.lora.manager import LoRAManager
        from lora_runtime.lora.sources import SourcePolicy

        backend = select_backend(config.lora_backend, mesh=mesh)
        manager = LoRAManager(
            model_config,
            mesh,
            num_slots=config.max_loras_per_batch,
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            max_cpu_bytes=config.max_cpu_lora_bytes,
            source_policy=SourcePolicy(
                allowed_roots=config.adapter_roots, max_adapter_bytes=config.max_adapter_bytes
            ),
            dtype=model_config.dtype,
        )
    runner = ModelRunner(model, model_config, config, mesh, backend)
    return Engine(runner, tokenizer, lora_manager=manager, model_name=model_name)
