"""Shared pieces of the LoRA kernels: platform choice and slot-sorted tile metadata.

The GPU kernels (bgmv for decode, sgmv for prefill; the TPU ones visit shared m-tiles
instead, kernels.sgmv.metadata) cut the slot-sorted tokens into tiles of `tm` tokens that
share one slot: segment s (its tokens contiguous after sorting)
gives ceil(len_s / tm) tiles. A kernel program handles one tile, so it reads its slot's
adapter once for up to `tm` tokens and feeds the matrix units a [tm, K] operand.
The "tile layout" of a per-token array puts tile g's tokens in rows [g*tm, g*tm + tm).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

PLATFORMS = ("cpu", "gpu", "tpu")


TPU_LANES = 128  # lanes of a TPU vector tile


def whole_lanes(n: int) -> int:
    """`n` rounded up to whole 128-lane tiles."""
    return -(-n // TPU_LANES) * TPU_LANES


def sublane_rows(dtype) -> int:
    """Rows of one TPU sublane tile: 8 of 32 bits, 16 of 16 bits."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def stored_elements(shape, dtype, platform: str | None) -> int:
    """Elements a device stores for an array of `shape`: on TPU the last two dims fill whole
    (sublane, 128-lane) tiles (a rank-8 bf16 [8, 4096] block takes 16 rows, a [128, 32] f32
    page 128 lanes), elsewhere exactly the shape."""
    dims = [int(n) for n in shape]
    if platform == "tpu" and dims:
        dims[-1] = whole_lanes(dims[-1])
        if len(dims) >= 2:
            rows = sublane_rows(dtype)
            dims[-2] = -(-dims[-2] // rows) * rows
    out = 1
    for n in dims:
        out *= n
    return out


def page_head_dim(head_dim: int, platform: str | None) -> int:
    """The last dim of a paged K/V cache: on "tpu" whole 128-lane tiles, a narrower head padded
    with zeros (the tiles hold the padding anyway, so it costs no memory), elsewhere head_dim.
    A cache of heads narrower than its tiles is laid out apart from how the kernels and XLA's
    own gathers read it, and XLA relayouts it, the whole cache, around every call."""
    return whole_lanes(head_dim) if platform == "tpu" else head_dim


def mxu_dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:  # f32
    """A Mosaic kernel's matrix product, accumulated in f32. float32 operands get full
    precision: the TPU's default multiplies them as bfloat16 (about 3 digits), which a
    float32 model would not expect; bfloat16 operands are unchanged."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST if exact else None)


def default_platform() -> str:
    """The platform the kernels dispatch on: "cpu", "gpu" or "tpu"."""
    backend = jax.default_backend()
    if backend in ("cuda", "rocm", "gpu"):
        return "gpu"
    if backend == "tpu":
        return "tpu"
    return "cpu"


def gpu_lowering_target(device_kind: str = "NVIDIA H200", num_cores: int = 132):
    """Context for lowering the Triton kernels without a GPU (ahead-of-time, tests).

    JAX >= 0.11 asks which GPU a Triton kernel targets and, with no GPU present, reads it
    from an abstract mesh's device; older JAX lowers without asking.
    """
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def stacked_pool(arrays, layer, per_layer_ndim: int = 3):
    """Pool arrays with a leading layer axis, and the layer index as i32[1].

    The kernels read a layer of a stacked pool ([L, S, ...]) in place, indexing the layer
    inside the kernel, so no layer slice is ever copied out of the stack (XLA would copy
    a slice that feeds a custom call). A per-layer array ([S, ...]) gets a unit layer axis
    (a free reshape) and layer 0. `arrays` is one array or a tuple of them; `layer` is an
    int or a traced integer scalar, required for stacked arrays and refused otherwise.
    """
    single = not isinstance(arrays, tuple)
    group = (arrays,) if single else arrays
    ndims = {arr.ndim for arr in group}
    if len(ndims) != 1:
        raise ValueError(f"pool arrays mix per-layer and stacked shapes: {[arr.shape for arr in group]}")
    ndim = ndims.pop()
    if ndim == per_layer_ndim:
        if layer is not None:
            raise ValueError(f"{layer=} given for a per-layer pool array of shape {group[0].shape}")
        group = tuple(arr[None] for arr in group)
        index = jnp.zeros((1,), jnp.int32)
    elif ndim == per_layer_ndim + 1:
        if layer is None:
            raise ValueError(f"a stacked pool array of shape {group[0].shape} needs the layer to read")
        if isinstance(layer, int) and not 0 <= layer < group[0].shape[0]:
            raise ValueError(f"{layer=} outside the pool's {group[0].shape[0]} layers")
        index = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    else:
        raise ValueError(f"pool array shape {group[0].shape} is neither per-layer nor stacked over layers")
    return (group[0] if single else group), index


def per_layer_aval(arr: jax.Array) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one layer of a stacked pool array (for the static checks)."""
    return jax.ShapeDtypeStruct(arr.shape[1:], arr.dtype)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_tiles(num_tokens: int, num_slots: int, tm: int) -> int:
    """Static bound on the tile count: sum_s ceil(c_s/tm) with sum c_s <= T, at most min(S, T) segments."""
    if num_tokens <= 0 or tm <= 0:
        raise ValueError(f"{num_tokens=} and tile size {tm=} must be positive")
    distinct = min(num_slots, num_tokens)
    return max(1, min(num_tokens, (num_tokens + distinct * (tm - 1)) // tm))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileMetadata:
    """Where each slot-sorted tile starts and ends, and which slot it uses.

    Tiles past `num_tiles` are empty (start == end) and carry the last real tile's slot,
    so a kernel that indexes weights by tile slot re-reads nothing for them.
    """

    order: jax.Array  # i32[T] sorted position -> token
    tile_slot: jax.Array  # i32[G]
    tile_start: jax.Array  # i32[G] first sorted position of the tile
    tile_end: jax.Array  # i32[G] one past its last sorted position
    token_row: jax.Array  # i32[T] token -> row in tile layout; -1 for no adapter
    num_tiles: jax.Array  # i32[]

    @property
    def grid_tiles(self) -> int:
        return self.tile_slot.shape[0]


def segments_from_slots(
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    num_slots: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # order i32[T], starts i32[S+1], slots i32[S]
    """Sorts tokens by slot inside the jit: one (possibly empty) segment per slot."""
    keys = jnp.where(token_slots < 0, num_slots, token_slots).astype(jnp.int32)
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    counts = jnp.bincount(keys, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    return order, starts, jnp.arange(num_slots, dtype=jnp.int32)


def tiles_from_segments(
    order: jax.Array,  # i32[T] sorted position -> token
    segment_starts: jax.Array,  # i32[N+1] segment i covers sorted [starts[i], starts[i+1])
    segment_slots: jax.Array,  # i32[N] slot of each segment (-1: unused, zero length)
    num_slots: int,
    tm: int,
) -> TileMetadata:
    """Cuts each segment into tiles of at most `tm` tokens (static count `max_tiles`)."""
    # searchsorted by compare_all: one fused [n, S] comparison, no sequential loop on device.
    num_tokens = order.shape[0]
    num_grid = max_tiles(num_tokens, min(num_slots, segment_slots.shape[0]), tm)  # segments bound the slots
    seg_len = segment_starts[1:] - segment_starts[:-1]
    seg_tiles = (seg_len + tm - 1) // tm
    tile_base = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seg_tiles, dtype=jnp.int32)])
    num_tiles = tile_base[-1]
    last_seg = seg_len.shape[0] - 1

    g = jnp.arange(num_grid, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(tile_base[1:], g, side="right", method="compare_all"), last_seg)
    start = segment_starts[seg] + (g - tile_base[seg]) * tm
    end = jnp.minimum(start + tm, segment_starts[seg + 1])
    real = g < num_tiles
    total = segment_starts[-1]
    tile_start = jnp.where(real, start, total).astype(jnp.int32)
    tile_end = jnp.where(real, end, total).astype(jnp.int32)
    last_real = jnp.maximum(num_tiles - 1, 0)
    fallback = jnp.maximum(segment_slots[seg[jnp.minimum(last_real, num_grid - 1)]], 0)
    tile_slot = jnp.where(real, segment_slots[seg], fallback).astype(jnp.int32)

    p = jnp.arange(num_tokens, dtype=jnp.int32)
    pseg = jnp.minimum(jnp.searchsorted(segment_starts[1:], p, side="right", method="compare_all"), last_seg)
    off = p - segment_starts[pseg]
    row = (tile_base[pseg] + off // tm) * tm + off % tm
    row = jnp.where(p < total, row, -1).astype(jnp.int32)
    token_row = jnp.full((num_tokens,), -1, jnp.int32).at[order].set(row)
    return TileMetadata(order, tile_slot, tile_start, tile_end, token_row, num_tiles.astype(jnp.int32))


def tiles_from_slots(
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    num_slots: int,
    tm: int,
) -> TileMetadata:
    """Tile metadata for a decode batch, sorted inside the jit."""
    order, starts, slots = segments_from_slots(token_slots, num_slots)
    return tiles_from_segments(order, starts, slots, num_slots, tm)


def gather_tile_rows(
    tile_values: jax.Array,  # [G*tm, C] per-row values in tile layout
    token_row: jax.Array,  # i32[T], -1 = no adapter
) -> jax.Array:  # [T, C], zero for tokens with no adapter
    """Brings tile-layout rows back to token order."""
    vals = tile_values[jnp.maximum(token_row, 0)]
    return jnp.where((token_row >= 0)[:, None], vals, jnp.zeros((), vals.dtype))
