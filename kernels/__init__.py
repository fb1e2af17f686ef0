"""Pallas LoRA kernels: BGMV (decode) and SGMV (prefill), for TPU (Mosaic) and GPU (Triton).

Pool layout (lora_runtime/lora/backend/base.py), rank on the second-to-last axis and the
large dimension last, so a rank-16 bf16 slice is one (16, 128) tile:
    A: [S, n*R, in]        n slices stacked on the rank axis
    B: n × [S, R, out_i]   one array per slice (q/k/v or gate/up may differ in out)
Both kernel families sort tokens by slot and cut each slot's run into tiles of tokens
that share one slot (kernels.common), so every distinct adapter is read once per tile
column and the matrix units get >= 16-row operands.

    kernels.bgmv   bgmv / bgmv_shrink / bgmv_expand   decode; sorts inside the jit
    kernels.sgmv   sgmv / sgmv_shrink / sgmv_expand   prefill; host-computed segments
    kernels.xla    the XLA formulations (CPU path and benchmark baselines)
"""
