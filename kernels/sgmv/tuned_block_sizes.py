"""Prefill block sizes: longer tiles than decode, since segments are long."""

from __future__ import annotations

from kernels.bgmv.tuned_block_sizes import BlockSizes, gpu_block_sizes, tpu_block_sizes


def block_sizes(platform: str, num_tokens: int, in_features: int, dtype) -> BlockSizes:
    """Prefill block sizes for a platform ("gpu" or "tpu")."""
    if platform == "gpu":
        return gpu_block_sizes(num_tokens, in_features, prefill=True)
    return tpu_block_sizes(dtype, prefill=True)
