"""Paged attention: queries of several sequences attend to their keys and values in a paged cache."""

from kernels.paged_attention.ops import ATTENTION_PLATFORMS, paged_attention
from kernels.paged_attention.ref import ref_paged_attention

__all__ = ["ATTENTION_PLATFORMS", "paged_attention", "ref_paged_attention"]
