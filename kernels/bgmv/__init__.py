"""BGMV: the decode-path LoRA op (per-token adapters, tokens sorted by slot in the jit)."""

from kernels.bgmv.ops import bgmv, bgmv_expand, bgmv_shrink

__all__ = ["bgmv", "bgmv_expand", "bgmv_shrink"]
