"""The XLA LoRA backend: the kernels' plain-XLA formulation, the fastest choice on CPU.

benchmarks/lora_kernels.py measures gather vs one-hot vs sorted segments on CPU; the
winner (kernels.xla.CPU_FORMULATION) is what this backend runs. Tensor parallelism
and op structure are the kernel backend's (shard_map per `parallel`).
"""

from __future__ import annotations

import jax

from lora_runtime.lora.backend.kernel import KernelLoRABackend


class XlaLoRABackend(KernelLoRABackend):
    """KernelLoRABackend pinned to the XLA formulation (no Pallas)."""

    name = "xla"

    def __init__(self, mesh: jax.sharding.Mesh | None = None):
        super().__init__(mesh, platform="cpu", interpret=False)
