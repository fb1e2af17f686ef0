"""Static and dynamic input checks name the bad value."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.bgmv import bgmv
from kernels.bgmv.validate import dynamic_validate_inputs, static_validate_inputs
from kernels.sgmv.validate import dynamic_validate_segments
from lora_runtime.errors import InvalidAdapterError
from lora_runtime.lora.batch_info import build_batch_info
from tests.kernels.naive import make_inputs


def inputs(**kw):
    d = make_inputs(5, 3, 8, (32, 16), 64, jnp.float32, seed=0, **kw)
    return d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], d["ranks"]


def test_static_checks_name_the_bad_shape():
    x, a, b, base, slots, scal, ranks = inputs()
    with pytest.raises(ValueError, match=r"A in-features 64 != x in-features 48"):
        static_validate_inputs(x[:, :48], a, b, base, slots, scal, ranks)
    with pytest.raises(ValueError, match=r"base output 1 shape \(5, 15\)"):
        static_validate_inputs(x, a, b, (base[0], base[1][:, :15]), slots, scal, ranks)
    with pytest.raises(ValueError, match=r"A dtype bfloat16 != x dtype float32"):
        static_validate_inputs(x, a.astype(jnp.bfloat16), b, base, slots, scal, ranks)
    with pytest.raises(ValueError, match=r"slot_scalings must be \[3\]"):
        bgmv(x, a, b, base, slots, scal[:2], ranks, platform="cpu")
    with pytest.raises(ValueError, match=r"2 B slices but 1 base outputs"):
        bgmv(x, a, b, base[:1], slots, scal, ranks, platform="cpu")


def test_dynamic_checks_name_the_bad_value():
    with pytest.raises(ValueError, match="token slot 3 outside"):
        dynamic_validate_inputs(np.array([0, 3]), np.array([8, 8, 8]), 8)
    with pytest.raises(InvalidAdapterError, match=r"rank=16 of slot=1 outside \[0, max_lora_rank=8\]"):
        dynamic_validate_inputs(np.array([0, 1]), np.array([8, 16, 8]), 8)
    dynamic_validate_inputs(np.array([-1, 2]), np.array([8, 1, 0]), 8)


def test_segment_checks():
    slots = np.array([1, -1, 0, 1], np.int32)
    info = build_batch_info(slots, np.ones(2, np.float32), np.full(2, 4, np.int32))
    dynamic_validate_segments(slots, info.sorted_order, info.segment_starts, info.segment_slots)
    wrong = np.array([1, 0, -1], np.int32)
    with pytest.raises(ValueError, match=r"segment 0 has slot 1 but holds tokens of slots \[0\]"):
        dynamic_validate_segments(slots, info.sorted_order, info.segment_starts, wrong)
    with pytest.raises(ValueError, match="not a permutation"):
        dynamic_validate_segments(slots, np.array([0, 0, 1, 2]), info.segment_starts, info.segment_slots)


def test_unknown_platform_is_named():
    x, a, b, base, slots, scal, ranks = inputs()
    with pytest.raises(ValueError, match="platform='npu'"):
        bgmv(x, a, b, base, slots, scal, ranks, platform="npu")
