"""The kernels lower for TPU (Mosaic) and GPU (Triton) at real model shapes, on CPU.

Llama-3-8B and Qwen2.5-7B projection groups with sizes divided by TP 1, 2, 4, 8 (column
groups split out, row groups split in). Lowering runs Mosaic's block-shape and tiling
checks and Triton's IR construction without a device.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from kernels.bgmv import bgmv
from kernels.bgmv.tuned_block_sizes import BlockSizes
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


def group_args(num_tokens, in_f, outs, layers=None):
    """x, A, B, base of one group; A and B stacked over `layers` when given (the engine's pool)."""
    n = len(outs)
    lead = () if layers is None else (layers,)
    return (
        sds((num_tokens, in_f), bf16), sds((*lead, NUM_SLOTS, n * RANK, in_f), bf16),
        tuple(sds((*lead, NUM_SLOTS, RANK, o), bf16) for o in outs), tuple(sds((num_tokens, o), bf16) for o in outs),
    )


def lower_bgmv(model, tp, platform, num_tokens=64, layers=None, block=None):
    gs = groups(model, tp)
    meta = (sds((num_tokens,), i32), sds((NUM_SLOTS,), f32), sds((NUM_SLOTS,), i32))
    layer = None if layers is None else layers - 1

    def step(all_args, slots, scal, ranks):
        return {g: bgmv(*args, slots, scal, ranks, layer=layer, platform=platform, block=block)
                for g, args in all_args.items()}

    all_args = {g: group_args(num_tokens, i, o, layers) for g, (i, o) in gs.items()}
    if platform == "gpu":
        with gpu_lowering_target():
            return jax.jit(step).trace(all_args, *meta).lower(lowering_platforms=("cuda",)).as_text()
    return jax.jit(step).trace(all_args, *meta).lower(lowering_platforms=(platform,)).as_text()


def lower_sgmv(model, tp, num_tokens=512, layers=None):
    gs = groups(model, tp)
    layer = None if layers is None else layers - 1
    meta = (sds((num_tokens,), i32), sds((num_tokens,), i32), sds((NUM_SLOTS + 1,), i32), sds((NUM_SLOTS,), i32),
            sds((NUM_SLOTS,), f32), sds((NUM_SLOTS,), i32))

    def step(all_args, *m):
        return {g: sgmv(*args, *m, layer=layer, platform="tpu") for g, args in all_args.items()}

    all_args = {g: group_args(num_tokens, i, o, layers) for g, (i, o) in gs.items()}
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


@pytest.mark.parametrize("num_tokens", [8, 64])
def test_tpu_decode_kernels_write_one_row_per_token(num_tokens):
    """On TPU a decode batch runs through the visits of shared m-tiles: every kernel's f32
    output has a row per token (rounded up to whole 16-row tiles), not a padded 16-row tile
    per distinct slot (64 tokens over 64 slots wrote 1024 rows of every 14336-wide
    projection before)."""
    text = lower_bgmv("llama3_8b", 1, "tpu", num_tokens=num_tokens, layers=32)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line and "tpu_custom_call" in line]
    rows = {int(m.group(1)) for line in calls for m in [re.search(r"\) -> tensor<(\d+)x\d+xf32>", line)]}
    assert len(calls) == 4 + 7 and rows == {-(-num_tokens // 16) * 16}, rows


@pytest.mark.parametrize("platform,tp", [("tpu", 1), ("tpu", 8), ("gpu", 1)])
def test_stacked_pool_lowering_real_shapes(platform, tp):
    """The engine's pool is stacked over 32 layers; a layer is read in place (no slice copy)."""
    text = lower_bgmv("llama3_8b", tp, platform, layers=32)
    if platform == "tpu":
        assert text.count("tpu_custom_call") == 4 + 7
        assert lower_sgmv("llama3_8b", tp, layers=32).count("tpu_custom_call") == 4 + 7
    else:
        assert text.count("__gpu$xla.gpu.triton") == 8
    # The pool reaches the kernels whole: no op makes a one-layer [S, rows, cols] bf16 array.
    per_layer = re.findall(rf"-> tensor<{NUM_SLOTS}x\d+x\d+xbf16>", text)
    assert not per_layer, per_layer[:3]
    assert re.search(rf"tensor<32x{NUM_SLOTS}x\d+x\d+xbf16>", text)
    if platform == "tpu":
        # ... and stays in HBM: each Mosaic kernel tells XLA its last operand, the pool, may
        # not be staged into faster memory (XLA copied whole stacked pools there every layer).
        for t in (text, lower_sgmv("llama3_8b", tp, layers=32)):
            colors = re.findall(
                r'input_memory_space_colors\\22: \[\{\\22operand_index\\22:(\d+),\\22color\\22:0\}\]', t)
            assert len(colors) == 4 + 7, t.count("input_memory_space_colors")


def test_gpu_single_launch_lowering_real_shapes():
    block = BlockSizes(tm=16, bk=256, bn=256, single_launch=True)
    text = lower_bgmv("qwen2_5_7b", 1, "gpu", layers=28, block=block)
    assert text.count("__gpu$xla.gpu.triton") == 4  # one kernel per projection group


VOCABS = {"llama3_8b": 128256, "qwen2_5_7b": 152064}


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("model,tp", [("llama3_8b", 1), ("llama3_8b", 8), ("qwen2_5_7b", 4)])
def test_lm_head_adapter_lowering_real_shapes(platform, model, tp):
    """lm_head adapters: x [T, hidden], A [1, S, R, hidden], B [1, S, R, vocab / tp] (the head is
    column-parallel on the vocabulary), added to f32 logits, decode and (TPU) prefill."""
    hidden, vocab, t = MODELS[model][0], VOCABS[model] // tp, 64
    x, a = sds((t, hidden), bf16), sds((1, NUM_SLOTS, RANK, hidden), bf16)
    b, logits = (sds((1, NUM_SLOTS, RANK, vocab), bf16),), (sds((t, vocab), f32),)
    meta = (sds((t,), i32), sds((NUM_SLOTS,), f32), sds((NUM_SLOTS,), i32))

    def step(x, a, b, logits, slots, scal, ranks):
        return bgmv(x, a, b, logits, slots, scal, ranks, layer=0, platform=platform)

    if platform == "gpu":
        with gpu_lowering_target():
            text = jax.jit(step).trace(x, a, b, logits, *meta).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2
        return
    text = jax.jit(step).trace(x, a, b, logits, *meta).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 2
    seg = (sds((t,), i32), sds((t,), i32), sds((NUM_SLOTS + 1,), i32), sds((NUM_SLOTS,), i32),
           sds((NUM_SLOTS,), f32), sds((NUM_SLOTS,), i32))

    def prefill(x, a, b, logits, *m):
        return sgmv(x, a, b, logits, *m, layer=0, platform="tpu")

    assert jax.jit(prefill).trace(x, a, b, logits, *seg).lower(lowering_platforms=("tpu",)).as_text().count(
        "tpu_custom_call") == 2


def scoped_vmem(text: str) -> list[int]:
    """The VMEM limits the Mosaic kernels of a lowering ask for (none: Mosaic's default)."""
    return [int(n) for n in re.findall(r'scoped_memory_configs\\22: \[\{\\22memory_space\\22:1, \\22offset\\22: 0, '
                                       r'\\22size\\22: (\d+)\}\]', text)]


def test_wide_adapters_ask_for_the_vmem_their_buffers_take():
    """A rank-128 prefill of Llama-3-8B's down_proj double-buffers a 128 x 14336 x block and
    128 rows of A (15 MiB): past Mosaic's default scoped VMEM, so the shrink asks for its
    buffers and headroom; a rank-16 decode stays on the default."""
    from kernels.slot_stream import DEFAULT_SCOPED_VMEM, VMEM_HEADROOM

    t, in_f, rank = 512, 14336, 128
    x, a, b, base = sds((t, in_f), bf16), sds((2, 4, rank, in_f), bf16), (sds((2, 4, rank, 4096), bf16),), (
        sds((t, 4096), bf16),)
    meta = (sds((t,), i32), sds((t,), i32), sds((5,), i32), sds((4,), i32), sds((4,), f32), sds((4,), i32))

    def prefill(x, a, b, base, *m):
        return sgmv(x, a, b, base, *m, layer=1, platform="tpu")

    limits = scoped_vmem(jax.jit(prefill).trace(x, a, b, base, *meta).lower(lowering_platforms=("tpu",)).as_text())
    tm = 128
    shrink = 2 * (rank * in_f * 2 + tm * in_f * 2 + tm * rank * 4) + VMEM_HEADROOM
    assert limits == [shrink] and shrink > DEFAULT_SCOPED_VMEM
    assert scoped_vmem(lower_bgmv("llama3_8b", 1, "tpu", layers=32)) == []


@pytest.mark.parametrize("parallel,prefill", [("column", False), ("row", True)])
def test_pool_constraint_lowers_inside_tensor_parallel_shard_map(parallel, prefill):
    """Under tensor parallelism the kernels run inside shard_map on each device's shard of the
    pool; the HBM constraint lowers there too, once per kernel."""
    import numpy as np
    from jax.sharding import Mesh

    from lora_runtime.lora.backend.kernel import KernelLoRABackend

    backend = KernelLoRABackend(Mesh(np.array(jax.devices()[:4]), ("tensor",)), platform="tpu")
    t, s, r, h, o = 16, 4, 16, 512, 1024
    n = 2 if parallel == "column" else 1
    in_f, out_f = (h, o) if parallel == "column" else (4096, h)
    x, a = jnp.zeros((t, in_f), bf16), jnp.zeros((2, s, n * r, in_f), bf16)
    b, base = (jnp.zeros((2, s, r, out_f), bf16),) * n, (jnp.zeros((t, out_f), bf16),) * n
    info = backend.prepare_lora_batch(np.zeros(t, np.int32), np.ones(s, np.float32), np.full(s, r, np.int32))
    step = jax.jit(lambda *args: backend.run_lora(*args, prefill=prefill, parallel=parallel, layer=1))
    text = step.trace(x, a, b, base, info).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1 + n
    assert text.count("input_memory_space_colors") == 1 + n
