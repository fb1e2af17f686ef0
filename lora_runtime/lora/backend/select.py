"""Chooses the LoRA backend by name, or the best one for this machine ("auto")."""

from __future__ import annotations

import jax

from kernels.common import default_platform
from lora_runtime.lora.backend.base import BaseLoRABackend

BACKENDS = ("auto", "reference", "xla", "pallas")


def select_backend(name: str = "auto", mesh: jax.sharding.Mesh | None = None) -> BaseLoRABackend:
    """"reference": plain jnp gather (the oracle); "xla": the fastest XLA formulation;
    "pallas": the Pallas kernels; "auto": pallas on GPU/TPU, xla on CPU."""
    if name not in BACKENDS:
        raise ValueError(f"LoRA backend {name!r} is not one of {BACKENDS}")
    if name == "auto":
        name = "xla" if default_platform() == "cpu" else "pallas"
    if name == "reference":
        from lora_runtime.lora.backend.reference import ReferenceLoRABackend

        return ReferenceLoRABackend(mesh)
    if name == "xla":
        from lora_runtime.lora.backend.xla import XlaLoRABackend

        return XlaLoRABackend(mesh)
    from lora_runtime.lora.backend.kernel import KernelLoRABackend

    return KernelLoRABackend(mesh)
