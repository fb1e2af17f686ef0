"""Assembles an engine: mesh, memory plan, sharded checkpoint, tokenizer, LoRA backend, pool and manager."""

from __future__ import annotations

import logging
import os

import jax

from kernels.common import default_platform, page_head_dim
from lora_runtime.engine import compile_events
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.memory_plan import MemoryPlan, device_memory_bytes, plan_memory, pool_classes, with_slots
from lora_runtime.engine.runner import ModelRunner
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.generation_defaults import read_generation_defaults
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from lora_runtime.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def build_engine(
    model_path: str, config: EngineConfig, *, model_name: str | None = None, tokenizer_path: str | None = None,
    plan: MemoryPlan | None = None,
) -> Engine:
    """An engine serving the HF checkpoint at `model_path` (not yet started).

    The memory plan is made from the checkpoint's config before any weight is read, so a
    configuration that does not fit is refused with nothing allocated; `plan` gives it instead
    (a multi-host replica's followers take their leader's, so every host's cache is one shape).
    `tokenizer_path`: a folder with tokenizer.json (and its config and chat template) to use
    instead of the checkpoint's own; generation_config.json still comes from the checkpoint.
    """
    model_config = ModelConfig.from_pretrained(model_path, dtype=config.dtype).for_tensor_parallel(
        config.tensor_parallel_size)
    model_config.check_max_seq_len(config.max_seq_len)
    mesh = make_mesh(config.tensor_parallel_size)
    plan = plan or make_plan(model_config, config, mesh)
    model_config, model = load_model(model_path, mesh, dtype=config.dtype, scan_layers=config.scan_layers)
    tokenizer = Tokenizer.from_pretrained(tokenizer_path or model_path, generation_config_dir=model_path)
    generation_defaults = read_generation_defaults(model_path)
    name = model_name or os.path.basename(os.path.normpath(model_path))
    engine = assemble_engine(model, model_config, tokenizer, config, mesh, model_name=name, plan=plan)
    engine.generation_defaults = generation_defaults
    return engine


def make_plan(model_config: ModelConfig, config: EngineConfig, mesh) -> MemoryPlan:
    """The replica's memory plan on this machine's platform, logged in one line."""
    platform = default_platform()
    # This process's devices: on a replica spanning hosts, the others' report to their own process.
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    plan = plan_memory(model_config, config, mesh, platform=platform, block_size=config.block_size(platform),
                       device_bytes=device_memory_bytes(local))
    logger.info("%s", plan.describe())
    return plan


def assemble_engine(
    model: LlamaModel,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    config: EngineConfig,
    mesh,
    *,
    model_name: str = "base",
    plan: MemoryPlan | None = None,
    attention: tuple[str, bool] | None = None,
) -> Engine:
    """An engine around an already-built model (tests and benchmarks use random weights).

    `attention` = (platform, interpret) picks the paged-attention formulation instead of the
    config's (tests run the TPU or GPU kernel in interpret mode on CPU).
    """
    model_config.check_max_seq_len(config.max_seq_len)
    if model.scan_layers != config.scan_layers:
        raise ValueError(f"the model was built with scan_layers={model.scan_layers}, the engine config "
                         f"says scan_layers={config.scan_layers}")
    cache_dir = compile_events.enable_persistent_cache(config.compilation_cache_path(),
                                                       config.compilation_cache_min_compile_s)
    if cache_dir:
        logger.info("persistent compilation cache: %s", cache_dir)
    plan = plan or make_plan(model_config, config, mesh)
    config = with_slots(config, plan.adapter_slots)  # the plan's count (adapter_memory_fraction sizes it)
    platform, interpret = attention or (config.attention_platform(plan.platform), False)
    backend = manager = None
    if config.max_loras_per_batch > 0:
        from lora_runtime.lora.backend.select import select_backend
        from lora_runtime.lora.manager import LoRAManager
        from lora_runtime.lora.sources import SourcePolicy

        from lora_runtime.lora.base_weights import BaseWeights

        backend = select_backend(config.lora_backend, mesh=mesh)
        classes = pool_classes(model_config, config, mesh.shape.get("tensor", 1))
        manager = LoRAManager(
            model_config,
            mesh,
            **(dict(rank_classes=classes) if classes else dict(num_slots=config.max_loras_per_batch)),
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            max_cpu_bytes=config.max_cpu_lora_bytes,
            source_policy=SourcePolicy(
                allowed_roots=config.adapter_roots, max_adapter_bytes=config.max_adapter_bytes
            ),
            dtype=model_config.dtype,
            base_weights=BaseWeights(model),
            outer=config.lora_embedding_modules,
            dora=config.lora_dora,
            bias=config.lora_bias,
            saved_module_bytes=config.lora_modules_to_save_max_bytes,
            saved_slots=config.lora_modules_to_save_slots,
            load_timeout_s=config.adapter_load_timeout_s,
        )
    # A TPU cache fills whole lane tiles (page_head_dim), as does one the TPU kernel reads
    # interpreted on another machine.
    width = page_head_dim(model_config.head_dim, "tpu" if "tpu" in (plan.platform, platform) else plan.platform)
    runner = ModelRunner(model, model_config, config, mesh, backend, num_blocks=plan.num_blocks,
                         block_size=plan.block_size, attention_platform=platform, interpret=interpret,
                         page_head_dim=width, program_dir=cache_dir and cache_dir.rstrip("/") + "/programs")
    engine = Engine(runner, tokenizer, lora_manager=manager, model_name=model_name)
    engine.memory_plan = plan
    return engine
