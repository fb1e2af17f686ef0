"""The kernels lower for TPU (Mosaic) and GPU (Triton) at real model shapes, on CPU.

Llama-3-8B and Qwen2.5-7B projection groups with sizes divided by TP 1, 2, 4, 8 (column
groups split out, row groups split in). Lowering runs Mosaic's block-shape and tiling
checks and Triton's IR construction without a device.
"""

import jax
import jax.numpy as jnp
import pytest

from kernels.bgmv import bgmv
from kernels.common import gpu_lowering_target
from kernels.sgmv import sgmv

MODELS = {  # hidden, intermediate, heads, kv_heads, head_dim
    "llama3_8b": (4096, 14336, 32, 8, 128),
    "qwen2_5_7b": (3584, 18944, 28, 4, 128),
}
NUM_SLOTS, RANK = 8, 16
i32, f32, bf16 = jnp.int32, jnp.float32, jnp.bfloat16


def groups(model: str, tp: int):
    hidden, inter, heads, kv, hd = MODELS[model]
    return {
        "qkv": (hidden, (heads * hd // tp, kv * hd // tp, kv * hd // tp)),
        "o": (heads * hd // tp, (hidden,)),
        "gate_up": (hidden, (inter // tp, inter // tp)),
        "down": (inter // tp, (hidden,)),
    }


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def group_args(num_tokens, in_f, outs):
    n = len(outs)
    return (
        sds((num_tokens, in_f), bf16), sds((NUM_SLOTS, n * RANK, in_f), bf16),
        tuple(sds((NUM_SLOTS, RANK, o), bf16) for o in outs), tuple(sds((num_tokens, o), bf16) for o in outs),
    )


def lower_bgmv(model, tp, platform, num_tokens=64):
    gs = groups(model, tp)
    meta = (sds((num_tokens,), i32), sds((NUM_SLOTS,), f32), sds((NUM_SLOTS,), i32))

    def step(all_args, slots, scal, ranks):
        return {g: bgmv(*args, slots, scal, ranks, platform=platform) for g, args in all_args.items()}

    all_args = {g: group_args(num_tokens, i, o) for g, (i, o) in gs.items()}
    if platform == "gpu":
        with gpu_lowering_target():
            return jax.jit(step).trace(all_args, *meta).lower(lowering_platforms=("cuda",)).as_text()
    return jax.jit(step).trace(all_args, *meta).lower(lowering_platforms=(platform,)).as_text()


def lower_sgmv(model, tp, num_tokens=512):
    gs = groups(model, tp)
    meta = (sds((num_tokens,), i32), sds((num_tokens,), i32), sds((NUM_SLOTS + 1,), i32), sds((NUM_SLOTS,), i32),
            sds((NUM_SLOTS,), f32), sds((NUM_SLOTS,), i32))

    def step(all_args, *m):
        return {g: sgmv(*args, *m, platform="tpu") for g, args in all_args.items()}

    all_args = {g: group_args(num_tokens, i, o) for g, (i, o) in gs.items()}
    return jax.jit(step).trace(all_args, *meta).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_tpu_lowering_real_shapes(model, tp):
    text = lower_bgmv(model, tp, "tpu")
    assert text.count("tpu_custom_call") == 4 + 7  # a shrink per group, an expand per slice
    text = lower_sgmv(model, tp)
    assert text.count("tpu_custom_call") == 4 + 7


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_gpu_triton_lowering_real_shapes(model, tp):
    text = lower_bgmv(model, tp, "gpu")
    assert text.count("__gpu$xla.gpu.triton") == 8  # one shrink and one (all-slice) expand per group
