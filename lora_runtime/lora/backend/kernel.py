"""The Pallas kernel LoRA backend: BGMV for decode, SGMV for prefill.

Under tensor parallelism (a mesh whose "tensor" axis has size > 1) each op runs inside
shard_map with the base layer's layout (see base.py): a column group keeps x and A
replicated and shards each B_i and y_i on out; a row group shards x and A on in and
psums the shrink, then expands replicated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels.bgmv import bgmv, bgmv_expand, bgmv_shrink
from kernels.common import PLATFORMS, default_platform
from kernels.sgmv import sgmv, sgmv_expand, sgmv_shrink
from lora_runtime.lora.backend.base import BaseLoRABackend
from lora_runtime.lora.batch_info import LoRABatchInfo

TENSOR_AXIS = "tensor"
PARALLEL = ("column", "row")


def _check_parallel(parallel: str) -> None:
    if parallel not in PARALLEL:
        raise ValueError(f"{parallel=} must be one of {PARALLEL}")


class KernelLoRABackend(BaseLoRABackend):
    """Applies adapters with the kernels of kernels/ on `platform` (default: this machine's).

    `platform="gpu"` or `"tpu"` with `interpret=True` runs the Pallas kernels in interpret
    mode on CPU (tests); `platform="cpu"` runs the kernels' XLA formulation.
    """

    name = "pallas"

    def __init__(self, mesh: jax.sharding.Mesh | None = None, *, platform: str | None = None,
                 interpret: bool = False):
        super().__init__(mesh)
        platform = default_platform() if platform is None else platform
        if platform not in PLATFORMS:
            raise ValueError(f"{platform=} is not one of {PLATFORMS}")
        self.platform = platform
        self.interpret = interpret

    # -- op bodies on local (per-device) arrays ---------------------------------------

    def _kw(self, layer) -> dict:
        return dict(platform=self.platform, interpret=self.interpret, layer=layer)

    def _shrink(self, x, a, info: LoRABatchInfo, prefill: bool, layer=None):
        # The interface does not say how many slices A stacks, so the standalone shrink
        # treats A as one slice of rank n*R and reads every row (padded rows are zero);
        # the fused run_lora knows the slices and skips rows past each adapter's rank.
        x = x.astype(a.dtype)  # the pool's dtype decides the matmul input type
        info = dataclasses.replace(info, slot_ranks=jnp.full_like(info.slot_ranks, a.shape[-2]))
        n_slices = 1
        if prefill:
            return sgmv_shrink(
                x, a, info.token_slots, info.sorted_order, info.segment_starts, info.segment_slots,
                info.slot_scalings, info.slot_ranks, n_slices=n_slices, **self._kw(layer),
            )
        return bgmv_shrink(x, a, info.token_slots, info.slot_scalings, info.slot_ranks, n_slices=n_slices,
                           **self._kw(layer))

    def _expand(self, v, b, base_outputs, info: LoRABatchInfo, prefill: bool, layer=None):
        if prefill:
            return sgmv_expand(
                v, b, base_outputs, info.token_slots, info.sorted_order, info.segment_starts,
                info.segment_slots, info.slot_scalings, info.slot_ranks, **self._kw(layer),
            )
        return bgmv_expand(v, b, base_outputs, info.token_slots, info.slot_scalings, info.slot_ranks,
                           **self._kw(layer))

    def _fused(self, x, a, b, base_outputs, info: LoRABatchInfo, prefill: bool, layer=None):
        x = x.astype(a.dtype)
        if prefill:
            return sgmv(
                x, a, b, base_outputs, info.token_slots, info.sorted_order, info.segment_starts,
                info.segment_slots, info.slot_scalings, info.slot_ranks, **self._kw(layer),
            )
        return bgmv(x, a, b, base_outputs, info.token_slots, info.slot_scalings, info.slot_ranks, **self._kw(layer))

    # -- tensor parallelism -------------------------------------------------------------

    def _tp(self) -> int:
        if self.mesh is None or TENSOR_AXIS not in self.mesh.axis_names:
            return 1
        return self.mesh.shape[TENSOR_AXIS]

    def _shard(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    @staticmethod
    def _info_spec(info: LoRABatchInfo):
        return jax.tree.map(lambda _: P(), info)

    @staticmethod
    def _pool_spec(layer, *last) -> P:
        """A pool array's spec: the per-layer axes' `last`, behind a layer axis when stacked."""
        return P(*((None,) if layer is not None else ()), None, None, *last)

    # -- BaseLoRABackend ----------------------------------------------------------------

    def run_lora_a_gemm(self, x, a, info, *, prefill: bool, parallel: str, layer=None):
        """Shrink: v[t] = (x[t] @ A[slot[t]]ᵀ) * scaling[slot[t]]; f32[T, n*R]."""
        _check_parallel(parallel)
        fn = functools.partial(self._shrink, prefill=prefill, layer=layer)
        if self._tp() == 1:
            return fn(x, a, info)
        if parallel == "column":
            return self._shard(fn, (P(), P(), self._info_spec(info)), P())(x, a, info)

        def row(x, a, info):
            return jax.lax.psum(fn(x, a, info), TENSOR_AXIS)

        a_spec = self._pool_spec(layer, TENSOR_AXIS)
        return self._shard(row, (P(None, TENSOR_AXIS), a_spec, self._info_spec(info)), P())(x, a, info)

    def run_lora_b_gemm(self, v, b, base_outputs, info, *, prefill: bool, parallel: str, layer=None):
        """Expand: y_i[t] = base_i[t] + v[t, i*R:(i+1)*R] @ B_i[slot[t]]."""
        _check_parallel(parallel)
        b, base_outputs = tuple(b), tuple(base_outputs)
        fn = functools.partial(self._expand, prefill=prefill, layer=layer)
        if self._tp() == 1:
            return fn(v, b, base_outputs, info)
        n = len(b)
        if parallel == "column":
            b_spec, y_spec = self._pool_spec(layer, TENSOR_AXIS), P(None, TENSOR_AXIS)
        else:
            b_spec, y_spec = P(), P()
        return self._shard(
            lambda v, b, y, info: fn(v, b, y, info),
            (P(), (b_spec,) * n, (y_spec,) * n, self._info_spec(info)),
            (y_spec,) * n,
        )(v, b, base_outputs, info)

    def run_lora(self, x, a, b, base_outputs, info, *, prefill: bool, parallel: str, layer=None):
        """Fused shrink + expand (row groups: shrink, psum, expand)."""
        _check_parallel(parallel)
        b, base_outputs = tuple(b), tuple(base_outputs)
        if self._tp() == 1:
            return self._fused(x, a, b, base_outputs, info, prefill, layer)
        if parallel == "row":
            # The shrink's partial sums must be reduced between the two kernels.
            v = self.run_lora_a_gemm(x, a, info, prefill=prefill, parallel=parallel, layer=layer)
            return self.run_lora_b_gemm(v, b, base_outputs, info, prefill=prefill, parallel=parallel, layer=layer)
        n = len(b)
        fn = functools.partial(self._fused, prefill=prefill, layer=layer)
        b_spec, y_spec = self._pool_spec(layer, TENSOR_AXIS), P(None, TENSOR_AXIS)
        return self._shard(
            lambda x, a, b, y, info: fn(x, a, b, y, info),
            (P(), P(), (b_spec,) * n, (y_spec,) * n, self._info_spec(info)),
            (y_spec,) * n,
        )(x, a, b, base_outputs, info)
