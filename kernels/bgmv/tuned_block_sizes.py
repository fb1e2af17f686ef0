"""Block sizes for the LoRA kernels, by platform and batch shape.

GPU (H200, Triton lowering): decode tiles are 16 tokens (the smallest MMA M); the
shrink splits K so that the few active tiles still fill the SMs; the expand's column
tile keeps each program's B read at rank x 256 elements. Prefill tiles are larger since
segments are long. TPU: the token block is one sublane tile (8 rows f32, 16 bf16), the
lane blocks are multiples of 128 dividing the feature size (or the whole dimension).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """One kernel configuration; GPU sizes are powers of two."""

    tm: int  # tokens per tile
    bk: int  # shrink K block
    bn: int  # expand column block
    num_splits: int = 1  # GPU split-K of the shrink
    num_warps: int = 4
    num_stages: int = 2
    single_launch: bool = False  # GPU fused op: shrink and expand in one kernel (no split-K)
    # TPU decode: 0, the visits kernels (kernels.sgmv.tpu); d > 0, the kernels walking the batch's
    # distinct slots with d weight blocks in flight (kernels.bgmv.tpu)
    slot_loop: int = 0


def gpu_block_sizes(num_tokens: int, in_features: int, *, prefill: bool) -> BlockSizes:
    """Triton sizes: enough split-K programs to cover ~132 SMs a few times over.

    Decode: the H200 sweep of benchmarks/device_check.py (T=64, S=64, H=O=4096, r=16,
    bf16, 16 stacked layers; benchmarks/results/2026-11-29-h200.md) put bn=1024 with
    bk=256 and 8 splits first at 22.9 us/layer, ahead of bn=256 (28.8), bn=512 (25.4-37.0)
    and 4 splits (24.1-24.5): the expand's few wide programs each read a longer B row.
    """
    tm = 64 if prefill and num_tokens >= 512 else 16
    bk = 256
    k_blocks = -(-in_features // bk)
    if prefill and num_tokens >= 512:
        return BlockSizes(tm=tm, bk=bk, bn=256, num_splits=max(1, min(4, k_blocks)), num_warps=4, num_stages=2)
    splits = max(1, min(8, k_blocks // 2))
    return BlockSizes(tm=tm, bk=bk, bn=1024, num_splits=splits, num_warps=4, num_stages=2)


# The TPU shrink keeps K whole (a rank-16 slice of in=14336 is 458 KB of VMEM): one DMA
# of an adapter's A rows serves a run of tiles of its slot (kernels.slot_stream), so each
# distinct adapter is read once. The TPU kernels do not read `bk`.
TPU_WHOLE_K = 1 << 16


# The TPU decode expand's widest column block: a whole gate/up projection of Llama-3-8B
# (14336) in one pass. Its buffers at rank 128 (B [128, 14336] bf16 and the f32 output
# block [16, 14336], each double-buffered) take 9.2 MiB of VMEM.
TPU_DECODE_BN = 16384


# The TPU decode kernels: 0, the visits kernels; d > 0, the kernels walking the batch's distinct
# slots with d weight blocks in flight (kernels.bgmv.tpu). On TPU v5e at 8 layers of Llama-3-8B
# widths, 32 rows of 16 rank-16 adapters through 64 slots, the decode step's device time was
# 5.87 ms with 4 in flight against 6.21 through the visits kernels (LoRA kernels 0.65 ms against
# 0.94 with their sort and gather); serving at 400 req/s, its decode program 5.85 ms against
# 6.19 (benchmarks/results/2026-12-07-tpu-v5e-serving-ops.md).
TPU_DECODE_SLOT_LOOP = 4
# The TPU prompt-step kernels: 0, the visits kernels; d > 0, the slot-loop kernels over row tiles
# of tm (each tile walking its own distinct slots). The visits stay until the chip has timed a
# serving run with these (in serving at 400 req/s the LoRA prompt program took 5.96 ms against
# the base's 4.89, of which the visits' sort and gather 0.27; `tpu_run.sh serving-prefill-loop`).
TPU_PREFILL_SLOT_LOOP = 0


def tpu_block_sizes(dtype, *, prefill: bool) -> BlockSizes:
    """Mosaic sizes: one sublane tile of tokens (more for prefill), whole K, wide out blocks.

    The TPU v5e sweep of benchmarks/device_check.py (T=64, S=64, H=O=4096, r=16, bf16, 16
    stacked layers; benchmarks/results/2026-12-06-tpu-v5e-lora-pool.md, the kernels fetching
    their own blocks) put tm=16 and bn=4096 first at 136 us/layer, ahead of bn=1024 (179) and
    tm=32 (171-214): fewer, wider expand steps, each reading a longer B row. Decode takes the
    whole width up to TPU_DECODE_BN: at out=14336, 8 tokens on 8 rank-16 slots, an expand call
    took 17.4 us in 4 column passes of 3584 and 8.9 us in one (rank 64: 29.1 against 25.9; 64
    tokens: 16.0 against 8.2; benchmarks/results/2026-12-07-tpu-v5e-long-decode.md). Prefill
    keeps 4096: its 128-row f32 output block of a 14336-wide pass would take 14 MiB."""
    sub = 16 if jnp.dtype(dtype).itemsize < 4 else 8
    if prefill:
        return BlockSizes(tm=sub * 8, bk=TPU_WHOLE_K, bn=4096, slot_loop=TPU_PREFILL_SLOT_LOOP)
    return BlockSizes(tm=sub, bk=TPU_WHOLE_K, bn=TPU_DECODE_BN, slot_loop=TPU_DECODE_SLOT_LOOP)
