"""SGMV: the prefill-path LoRA op (tokens of one adapter contiguous after sorting)."""

from kernels.sgmv.ops import sgmv, sgmv_expand, sgmv_shrink

__all__ = ["sgmv", "sgmv_expand", "sgmv_shrink"]
