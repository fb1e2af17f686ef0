"""SGMV: the prefill-path LoRA op (tokens of one adapter contiguous after sorting)."""

from kernels.sgmv.ops import sgmv

__all__ = ["sgmv"]
