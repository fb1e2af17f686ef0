"""Device buffers holding the adapters of every slot, laid out as backends read them.

The slots come in rank classes (`RankClass`: a rank and a slot count, ascending by rank);
one class of `max_lora_rank` is the padded pool every engine ships, several let a rank-8
adapter take an 8-row slot instead of a 64-row one. Slot ids are global: class c owns
slots [first_slot, first_slot + num_slots), so the per-slot metadata of a step (scaling,
rank, flags) stays one array and a class's tokens are contiguous once sorted by slot.

Per class c and projection group, stacked over layers:
    a[c][g]: [L, S_c, n*R_c, in]          b[c][g]: n × [L, S_c, R_c, out_i]
so `pool.stacked_group(g, c)` gives the backend layout (lora_runtime/lora/backend/base.py)
with the layer index kept apart: kernels read a layer in place (a slice feeding a custom
call would be copied each step). Column groups (qkv, gate_up) keep A replicated and shard
each B_i on out; row groups (o, down) shard A on in and keep B replicated, matching the
base weights' tensor-parallel layout.

A pool created with `outer=True` also holds the groups "embed_tokens" (A [1, S, R, vocab],
B [1, S, R, hidden]; A sharded on vocab like the base embedding) and "lm_head" (A
[1, S, R, hidden], B [1, S, R, vocab]; column-parallel on vocab like the base head, or
row-parallel when the mesh does not divide the vocabulary). With `dora=True` it holds
DoRA's per-output scale of every slot, `scale[c][g]`: n × [L, S_c', out_i] f32 (1 for a
plain adapter), sharded like the outputs. A per-output shift `shift[c][g]` (same layout, 0
for an adapter without one) is held for the groups whose base layer has a bias when
`dora=True` (DoRA's (1 - scale) * bias), and for every group but the embedding when
`bias=True` (PEFT's lora_bias: lora_B's bias times the module's scaling); the step computes
y = scale * (base + delta) + shift. These are the slots' output terms (OutputTerms).

Every array's second-minor axis fills whole tiles on TPU (`row_align`, TPU_ROW_ALIGN): A's
n*R_c' and B's R_c' rows, R_c' being R_c rounded up (the rows past R_c stay zero), and the
terms' S_c' slots, S_c rounded up (the slots past S_c are never written or read). Elsewhere
R_c' = R_c and S_c' = S_c.

Adapters whose modules_to_save hold a trained embed_tokens or lm_head get a saved-module
slot beside their adapter slot: `saved[m]` per module the pool has room for (embed_tokens
[S', vocab, hidden], sharded on vocab like the base embedding; lm_head [S', hidden, vocab],
like the base head's kernel). A step's LoRABatchInfo.slot_saved maps each adapter slot to
its saved-module slots; a token whose adapter has one reads that copy instead of the base
module. Saved-module slots are few (each is a whole module), so they are managed apart
from the rank classes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from kernels.common import cdiv
from lora_runtime.lora.adapter import EMBED, HEAD, OUTER_MODULES, group_shapes, outer_shapes
from lora_runtime.model.lora_hook import GROUPS
from lora_runtime.model.sharding import zeros_on

TENSOR_AXIS = "tensor"
COLUMN_GROUPS = ("qkv", "gate_up")
# Which base layers of a group have a bias, by ModelConfig field.
_BIAS_FIELD = {"qkv": "attention_bias", "o": "attention_out_bias", "gate_up": "mlp_bias", "down": "mlp_bias"}


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """The static shape of a pool: its groups, their parallelism and what each slot holds."""

    groups: tuple[str, ...]  # GROUPS, then OUTER_MODULES when the pool holds them
    parallel: tuple[str, ...]  # per group: "column" or "row"
    vocab_sharded: bool  # the embedding's A is sharded on vocab (the mesh divides it)
    dora: bool
    shifted: tuple[bool, ...]  # per group: a shift is held (see the module docstring)
    saved: tuple[str, ...] = ()  # modules (OUTER_MODULES order) with saved-module slots
    bias: bool = False  # slots hold lora_bias shifts

    @classmethod
    def of(cls, model_config, tp: int, *, outer: bool, dora: bool, bias: bool = False,
           saved: Sequence[str] = ()) -> PoolLayout:
        groups = GROUPS + (OUTER_MODULES if outer else ())
        vocab_ok = model_config.vocab_size % tp == 0
        parallel = tuple("column" if g in COLUMN_GROUPS or (g == HEAD and vocab_ok) else "row" for g in groups)
        base_biased = tuple(bool(getattr(model_config, _BIAS_FIELD[g], False)) if g in _BIAS_FIELD else False
                            for g in groups)
        shifted = tuple((dora and b) or (bias and g != EMBED) for g, b in zip(groups, base_biased))
        unknown = set(saved) - set(OUTER_MODULES)
        if unknown:
            raise ValueError(f"saved modules {sorted(unknown)}: only {list(OUTER_MODULES)} can be saved")
        return cls(groups=groups, parallel=parallel, vocab_sharded=vocab_ok, dora=dora, shifted=shifted,
                   saved=tuple(m for m in OUTER_MODULES if m in saved), bias=bias)

    @property
    def has_terms(self) -> bool:
        """Whether slots hold output terms (DoRA scales or shifts)."""
        return self.dora or self.bias

    def saved_spec(self, module: str) -> P:
        """PartitionSpec of a saved-module table: embed_tokens [S', vocab, hidden], lm_head
        [S', hidden, vocab], the vocabulary split where the mesh divides it."""
        vocab = TENSOR_AXIS if self.vocab_sharded else None
        return P(None, vocab, None) if module == EMBED else P(None, None, vocab)

    def specs(self, group: str) -> tuple[P, P, P]:
        """PartitionSpecs of a group's A [L, S, n*R, in], each B_i [L, S, R, out_i] and each
        scale/shift [L, S, out_i]."""
        if group == EMBED:
            return (P(None, None, None, TENSOR_AXIS if self.vocab_sharded else None), P(None, None, None, None),
                    P(None, None, None))
        column = self.parallel[self.groups.index(group)] == "column"
        if column:
            return P(None, None, None, None), P(None, None, None, TENSOR_AXIS), P(None, None, TENSOR_AXIS)
        return P(None, None, None, TENSOR_AXIS), P(None, None, None, None), P(None, None, None)

    def has_scale(self, group: str) -> bool:
        return self.dora and group != EMBED


@dataclasses.dataclass(frozen=True)
class RankClass:
    """Slots [first_slot, first_slot + num_slots) of the pool, each for adapters up to `rank`,
    held in `rows` rows (`rank` rounded up to the pool's row_align)."""

    rank: int
    num_slots: int
    first_slot: int
    rows: int = 0  # 0: `rank`

    def __post_init__(self):
        if not self.rows:
            object.__setattr__(self, "rows", self.rank)

    def holds(self, slot: int) -> bool:
        return self.first_slot <= slot < self.first_slot + self.num_slots


def rank_classes(spec: Sequence[tuple[int, int]]) -> tuple[RankClass, ...]:
    """Classes from (rank, slots) pairs: ascending distinct ranks, every count positive."""
    spec = [(int(r), int(n)) for r, n in spec]
    if not spec:
        raise ValueError("a pool needs at least one rank class")
    ranks = [r for r, _ in spec]
    if ranks != sorted(set(ranks)):
        raise ValueError(f"rank classes {ranks} must be distinct and ascending")
    for r, n in spec:
        if r <= 0:
            raise ValueError(f"rank class {r} must be positive")
        if n <= 0:
            raise ValueError(f"rank class {r} has num_slots={n}; it must be positive")
    out, first = [], 0
    for r, n in spec:
        out.append(RankClass(rank=r, num_slots=n, first_slot=first))
        first += n
    return tuple(out)


def group_dims(model_config, group: str) -> tuple[int, int, tuple[int, ...]]:
    """(layers, in, (out_i per slice)) of a pool group."""
    if group in OUTER_MODULES:
        fan_in, fan_out = outer_shapes(model_config)[group]
        return 1, fan_in, (fan_out,)
    fan_in, outs = group_shapes(model_config)[group]
    return model_config.num_layers, fan_in, outs


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=("a", "b", "scale", "shift", "saved"),
    meta_fields=("mesh", "classes", "layout"),
)
@dataclasses.dataclass(frozen=True)
class LoRAMemoryPool:
    """Every slot's adapter weights for all layers and groups; a pytree of device arrays."""

    a: tuple[tuple[jax.Array, ...], ...]  # per class, per group in layout.groups: [L, S_c, n*R_c, in]
    b: tuple[tuple[tuple[jax.Array, ...], ...], ...]  # per class, per group: n × [L, S_c, R_c, out_i]
    mesh: jax.sharding.Mesh
    classes: tuple[RankClass, ...]
    layout: PoolLayout
    scale: tuple = ()  # per class, per group: n × f32[L, S_c, out_i] with DoRA, else (); () without terms
    shift: tuple = ()  # per class, per group: n × f32[L, S_c, out_i] where shifted, else (); () without terms
    saved: tuple = ()  # per module of layout.saved: its saved-module table (see the module docstring)

    @classmethod
    def create(cls, model_config, mesh: jax.sharding.Mesh, *, dtype, num_slots: int | None = None,
               max_lora_rank: int | None = None, classes: Sequence[tuple[int, int]] | None = None,
               outer: bool = False, dora: bool = False, bias: bool = False, saved_modules: Sequence[str] = (),
               saved_slots: int = 0, row_align: int | None = None) -> LoRAMemoryPool:
        """An empty pool sharded on `mesh`: `num_slots` slots of rank `max_lora_rank`, or the
        rank `classes` ((rank, slots) pairs); `outer`: room for embed_tokens and lm_head
        adapters, `dora`: for DoRA scales, `bias`: for lora_bias shifts; `saved_slots`
        saved-module slots for each of `saved_modules` (modules_to_save copies of embed_tokens
        and lm_head); `row_align`: what the rows and the terms' slots are rounded up to (None:
        the mesh's platform's, row_align_for)."""
        if classes is None:
            if num_slots is None or max_lora_rank is None:
                raise ValueError("a pool needs num_slots and max_lora_rank, or rank classes")
            if num_slots <= 0:
                raise ValueError(f"{num_slots=} must be positive")
            if max_lora_rank <= 0:
                raise ValueError(f"{max_lora_rank=} must be positive")
            classes = ((max_lora_rank, num_slots),)
        elif num_slots is not None or max_lora_rank is not None:
            raise ValueError("give rank classes or num_slots and max_lora_rank, not both")
        align = row_align_for(mesh.devices.flat[0].platform) if row_align is None else row_align
        classes = tuple(dataclasses.replace(rc, rows=aligned(rc.rank, align)) for rc in rank_classes(classes))
        tp = mesh.shape.get(TENSOR_AXIS, 1)
        if saved_modules and saved_slots <= 0:
            raise ValueError(f"saved modules {list(saved_modules)} need saved_slots > 0, got {saved_slots}")
        layout = PoolLayout.of(model_config, tp, outer=outer, dora=dora, bias=bias, saved=saved_modules)
        for g, parallel in zip(layout.groups, layout.parallel):
            _, fan_in, outs = group_dims(model_config, g)
            # The dimensions the mesh splits (the embedding's vocab only where it divides it).
            if g == EMBED:
                sharded = (fan_in,) if layout.vocab_sharded else ()
            else:
                sharded = outs if parallel == "column" else (fan_in,)
            for dim in sharded:
                if dim % tp:
                    raise ValueError(f"group {g!r} dimension {dim} is not divisible by tensor parallel size {tp}")
        a, b, scale, shift = [], [], [], []
        for rc in classes:
            parts = _class_buffers(model_config, mesh, layout, rc, dtype, align)
            a.append(parts[0])
            b.append(parts[1])
            scale.append(parts[2])
            shift.append(parts[3])
        saved = tuple(zeros_on((saved_slots,) + saved_shape(model_config, m), dtype,
                               NamedSharding(mesh, layout.saved_spec(m))) for m in layout.saved)
        terms = layout.has_terms
        return cls(a=tuple(a), b=tuple(b), mesh=mesh, classes=classes, layout=layout,
                   scale=tuple(scale) if terms else (), shift=tuple(shift) if terms else (), saved=saved)

    @property
    def groups(self) -> tuple[str, ...]:
        return self.layout.groups

    def holds(self, group: str) -> bool:
        return group in self.groups

    @property
    def dora(self) -> bool:
        return self.layout.dora

    @property
    def bias(self) -> bool:
        """Whether slots hold lora_bias shifts."""
        return self.layout.bias

    @property
    def has_terms(self) -> bool:
        """Whether slots hold output terms (DoRA scales, DoRA or lora_bias shifts)."""
        return self.layout.has_terms

    def has_saved(self, module: str) -> bool:
        """Whether the pool has saved-module slots for `module` (modules_to_save copies)."""
        return module in self.layout.saved

    def adapts(self, module: str) -> bool:
        """Whether an adapter may change `module` (embed_tokens or lm_head) here: a LoRA of it or a saved copy."""
        return self.holds(module) or self.has_saved(module)

    def saved_table(self, module: str) -> jax.Array:
        """The saved-module table of `module`: embed_tokens [S', vocab, hidden], lm_head [S', hidden, vocab]."""
        return self.saved[self.layout.saved.index(module)]

    @property
    def num_saved_slots(self) -> int:
        return self.saved[0].shape[0] if self.saved else 0

    def parallel(self, group: str) -> str:
        return self.layout.parallel[self.groups.index(group)]

    @property
    def num_slots(self) -> int:
        return sum(rc.num_slots for rc in self.classes)

    @property
    def max_lora_rank(self) -> int:
        return self.classes[-1].rank

    def class_of(self, slot: int) -> int:
        """The index of the rank class holding `slot`."""
        _check_slot(self, slot)
        return next(i for i, rc in enumerate(self.classes) if rc.holds(slot))

    def class_for_rank(self, rank: int) -> int:
        """The index of the narrowest class an adapter of `rank` fits."""
        for i, rc in enumerate(self.classes):
            if rc.rank >= rank:
                return i
        raise ValueError(f"{rank=} exceeds the pool's widest rank class ({self.max_lora_rank})")

    def group(self, layer, group: str, c: int = 0) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(A [S_c, n*R_c, in], B n × [S_c, R_c, out_i]) of one layer, group and class;
        `layer` may be traced."""
        a, bs = self.stacked_group(group, c)
        return a[layer], tuple(b[layer] for b in bs)

    def stacked_group(self, group: str, c: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(A [L, S_c, n*R_c, in], B n × [L, S_c, R_c, out_i]) of one group and class, all layers."""
        g = self.groups.index(group)
        return self.a[c][g], self.b[c][g]

    def output_terms(self, group: str, c: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """(scale, shift) of a group and class, each n × f32[L, S_c, out_i], or () where not held."""
        g = self.groups.index(group)
        return self.scale[c][g], self.shift[c][g]

    @property
    def num_layers(self) -> int:
        return self.a[0][0].shape[0]

    @property
    def dtype(self):
        return self.a[0][0].dtype

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    def slot_nbytes(self, c: int = 0) -> int:
        """Bytes of one slot of class `c` (an adapter's padded layout, output terms included)."""
        leaves = jax.tree_util.tree_leaves((self.a[c], self.b[c], self.scale[c] if self.has_terms else (),
                                            self.shift[c] if self.has_terms else ()))
        return sum(x.nbytes for x in leaves) // self.classes[c].num_slots

    def _specs(self, group: str) -> tuple[P, P, P]:
        return self.layout.specs(group)

    def slot_shardings(self) -> tuple[tuple[NamedSharding, tuple[NamedSharding, ...]], ...]:
        """Shardings of one slot's weights ([L, n*R, in] and [L, R, out_i]) per group."""
        out = []
        for g, bs in zip(self.groups, self.b[0]):
            a_spec, b_spec, _ = self._specs(g)
            out.append((NamedSharding(self.mesh, _without_slot_axis(a_spec)),
                        tuple(NamedSharding(self.mesh, _without_slot_axis(b_spec)) for _ in bs)))
        return tuple(out)

    def term_shapes(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """Per group, the [L, out_i] shapes of one slot's scales and shifts."""
        if not self.has_terms:
            return (), ()
        return tuple(tuple((x.shape[0], x.shape[2]) for x in ts) for ts in self.scale[0]), \
            tuple(tuple((x.shape[0], x.shape[2]) for x in ts) for ts in self.shift[0])


def saved_modules_within(model_config, max_bytes: int, dtype) -> tuple[str, ...]:
    """The modules (embed_tokens, lm_head) whose whole copy in `dtype` fits `max_bytes`: the
    ones a pool with that per-adapter cap on modules_to_save needs saved-module slots for."""
    one = model_config.vocab_size * model_config.hidden_size * np.dtype(dtype).itemsize
    return OUTER_MODULES if one <= max_bytes else ()


def saved_shape(model_config, module: str) -> tuple[int, int]:
    """One saved-module slot's shape: embed_tokens [vocab, hidden], lm_head [hidden, vocab] (the base head's kernel)."""
    v, h = model_config.vocab_size, model_config.hidden_size
    return (v, h) if module == EMBED else (h, v)


def _class_buffers(model_config, mesh, layout: PoolLayout, rc: RankClass, dtype, align: int):
    """(A, B, scale, shift) per group of one empty rank class."""
    a, b, scale, shift = [], [], [], []
    held = aligned(rc.num_slots, align)
    for g, shifted in zip(layout.groups, layout.shifted):
        depth, fan_in, outs = group_dims(model_config, g)
        a_spec, b_spec, s_spec = layout.specs(g)
        a.append(zeros_on((depth, rc.num_slots, len(outs) * rc.rows, fan_in), dtype, NamedSharding(mesh, a_spec)))
        b.append(tuple(zeros_on((depth, rc.num_slots, rc.rows, o), dtype, NamedSharding(mesh, b_spec))
                       for o in outs))
        scale.append(tuple(_ones_on((depth, held, o), NamedSharding(mesh, s_spec)) for o in outs)
                     if layout.has_scale(g) else ())
        shift.append(tuple(zeros_on((depth, held, o), jnp.float32, NamedSharding(mesh, s_spec))
                           for o in outs) if shifted else ())
    return tuple(a), tuple(b), tuple(scale), tuple(shift)


# A pooled array's second-minor axis is tiled by 8 on TPU (f32 (8, 128) tiles, bf16 (8, 128)(2, 1)).
# Off that tile the runtime stores the array in a compact layout with another axis second-minor,
# and every program that reads it copies the whole array back first: the f32 output terms of 63
# slots sized from memory (layer axis second-minor) cost the LoRA decode program 8.8 ms a run
# against 6.2 without (TPU v5e, 8 layers of Llama-3-8B widths;
# benchmarks/results/2026-12-07-tpu-v5e-serving-ops.md), as a KV cache of 64-wide heads did
# (kernels.common.page_head_dim). A's n*R and B's R rows are the same kind of axis (rank 4: 12
# rows of qkv), so they are rounded up too.
TPU_ROW_ALIGN = 8


def row_align_for(platform: str | None) -> int:
    """What a pool's rows and terms' slots are rounded up to on `platform`."""
    return TPU_ROW_ALIGN if platform == "tpu" else 1


def aligned(n: int, align: int) -> int:
    """`n` rounded up to a multiple of `align`."""
    return cdiv(n, align) * align


def _without_slot_axis(spec: P) -> P:
    return P(spec[0], *spec[2:])


def _ones_on(shape, sharding) -> jax.Array:
    return jax.jit(lambda: jnp.ones(shape, jnp.float32), out_shardings=sharding)()


@dataclasses.dataclass(frozen=True)
class OutputTerms:
    """One adapter's per-output scale and shift per group (n × f32[L, out_i], each only
    where the pool holds it); lora_runtime/lora/dora.py computes them."""

    scale: dict[str, tuple[np.ndarray, ...]]
    shift: dict[str, tuple[np.ndarray, ...]]


def plain_terms(pool: LoRAMemoryPool) -> OutputTerms | None:
    """The output terms of an adapter without DoRA or lora_bias (scale 1, shift 0), for a
    pool that holds them."""
    if not pool.has_terms:
        return None
    scales, shifts = pool.term_shapes()
    return OutputTerms(scale={g: tuple(np.ones(s, np.float32) for s in ss) for g, ss in zip(pool.groups, scales)},
                     shift={g: tuple(np.zeros(s, np.float32) for s in ss) for g, ss in zip(pool.groups, shifts)})


def slot_rank(pool: LoRAMemoryPool, weights: dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]]) -> int:
    """The rank an adapter's pool layout was padded to (LoRAAdapter.pool_weights), checked
    against the pool's groups and shapes."""
    missing = [g for g in pool.groups if g not in weights]
    if missing:
        raise ValueError(f"slot weights lack groups {missing} the pool holds (pool_weights(outer=...))")
    rank = None
    for g, (a, bs) in weights.items():
        if g not in pool.groups:
            raise ValueError(f"slot weights hold group {g!r}, which the pool does not")
        want_a, want_b = pool.a[-1][pool.groups.index(g)], pool.b[-1][pool.groups.index(g)]
        n = len(want_b)
        r = a.shape[1] // n if a.ndim == 3 else -1
        ok = (len(bs) == n and a.ndim == 3 and a.shape[1] == n * r
              and (a.shape[0], a.shape[2]) == (want_a.shape[0], want_a.shape[3])
              and all(x.shape == (y.shape[0], r, y.shape[3]) for x, y in zip(bs, want_b)))
        if not ok or r > pool.max_lora_rank or (rank is not None and r != rank):
            raise ValueError(f"slot weights for group {g!r} have shapes {a.shape}, {[x.shape for x in bs]}; "
                             f"pool wants ({want_a.shape[0]}, {n}*rank, {want_a.shape[3]}), "
                             f"{[(y.shape[0], 'rank', y.shape[3]) for y in want_b]} with one rank <= "
                             f"{pool.max_lora_rank} for every group")
        rank = r
    return rank


def put_slot_weights(pool: LoRAMemoryPool,
                     weights: dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]], terms: OutputTerms | None = None):
    """Moves one adapter's pool layout (LoRAAdapter.pool_weights, and its output terms for a
    pool that holds them) to the devices, sharded like the pool."""
    out = []
    for g, (a_sh, b_sh) in zip(pool.groups, pool.slot_shardings()):
        a, bs = weights[g]
        out.append((jax.device_put(np.asarray(a, pool.dtype), a_sh),
                    tuple(jax.device_put(np.asarray(b, pool.dtype), s) for b, s in zip(bs, b_sh))))
    if not pool.has_terms:
        return tuple(out), (), ()
    terms = terms or plain_terms(pool)
    scale_shapes, shift_shapes = pool.term_shapes()

    def put(values: dict, shapes) -> tuple:
        out = []
        for g, held in zip(pool.groups, shapes):
            xs = values.get(g, ())
            if len(xs) != len(held) or any(x.shape != h for x, h in zip(xs, held)):
                raise ValueError(f"output terms for group {g!r} have shapes {[x.shape for x in xs]}; the pool "
                                 f"wants {list(held)}")
            sharding = NamedSharding(pool.mesh, _without_slot_axis(pool._specs(g)[2]))
            out.append(tuple(jax.device_put(np.asarray(x, np.float32), sharding) for x in xs))
        return tuple(out)

    return tuple(out), put(terms.scale, scale_shapes), put(terms.shift, shift_shapes)


def _widen(x: jax.Array, n: int, rank: int, axis: int) -> jax.Array:
    """A slot's [L, n*r, ...] (axis 1) array padded with zero rows to n*rank, slice by slice."""
    r = x.shape[axis] // n
    if r == rank:
        return x
    parts = x.reshape(x.shape[:axis] + (n, r) + x.shape[axis + 1:])
    pad = [(0, 0)] * parts.ndim
    pad[axis + 1] = (0, rank - r)
    return jnp.pad(parts, pad).reshape(x.shape[:axis] + (n * rank,) + x.shape[axis + 1:])


def _set_slot(part, slot: jax.Array, weights, scale=(), shift=(), *, rank: int):
    """One class's buffers with `slot` holding `weights[g] = (A, B_tuple)` (padded to the
    class's `rank` here, on the device) and its output scale/shift, or scalars to fill it with."""
    a_buf, b_buf, sc_buf, sh_buf = part
    a = tuple(buf.at[:, slot].set(w[0] if jnp.ndim(w[0]) == 0 else _widen(w[0], len(w[1]), rank, 1))
              for buf, w in zip(a_buf, weights))
    b = tuple(tuple(buf.at[:, slot].set(x if jnp.ndim(x) == 0 else _widen(x, 1, rank, 1)) for buf, x in zip(bufs, w[1]))
              for bufs, w in zip(b_buf, weights))
    sc = tuple(tuple(buf.at[:, slot].set(x) for buf, x in zip(bufs, xs)) for bufs, xs in zip(sc_buf, scale))
    sh = tuple(tuple(buf.at[:, slot].set(x) for buf, x in zip(bufs, xs)) for bufs, xs in zip(sh_buf, shift))
    return a, b, sc, sh


def _clear_slot(part, slot: jax.Array, *, rank: int):
    a_buf, b_buf, sc_buf, sh_buf = part
    zeros = tuple((jnp.zeros((), buf.dtype), tuple(jnp.zeros((), buf.dtype) for _ in bs))
                  for buf, bs in zip(a_buf, b_buf))
    ones = tuple(tuple(jnp.ones((), jnp.float32) for _ in ts) for ts in sc_buf)
    nothing = tuple(tuple(jnp.zeros((), jnp.float32) for _ in ts) for ts in sh_buf)
    return _set_slot(part, slot, zeros, ones, nothing, rank=rank)


@functools.cache
def updater(kind: str, rank: int, out_shardings):
    """The jitted slot update ("write" or "clear") of one rank class's buffers, sharded as
    `out_shardings`.

    Explicit output shardings keep every buffer's sharding exactly as created (XLA
    would otherwise normalize trivial ones), so a step jitted on the pool never
    recompiles after a write. One compile per class and written rank, whatever the slot.
    """
    fn = {"write": _set_slot, "clear": _clear_slot}[kind]
    return jax.jit(functools.partial(fn, rank=rank), donate_argnums=0, out_shardings=out_shardings)


def _part(pool: LoRAMemoryPool, c: int):
    """Class c's buffers as the updater takes them: (A, B, scale, shift) per group."""
    if pool.has_terms:
        return pool.a[c], pool.b[c], pool.scale[c], pool.shift[c]
    return pool.a[c], pool.b[c], (), ()


def _part_shardings(pool: LoRAMemoryPool, c: int):
    return jax.tree.map(lambda x: x.sharding, _part(pool, c))


def _with_part(pool: LoRAMemoryPool, c: int, part) -> LoRAMemoryPool:
    a, b, sc, sh = part

    def put(xs, x):
        return xs[:c] + (x,) + xs[c + 1:]

    return dataclasses.replace(pool, a=put(pool.a, a), b=put(pool.b, b),
                               scale=put(pool.scale, sc) if pool.has_terms else (),
                               shift=put(pool.shift, sh) if pool.has_terms else ())


@dataclasses.dataclass(frozen=True)
class StagedSlot:
    """One adapter's slot layout already on the devices, sharded like the pool: what a slot
    write copies in place. Staging moves the bytes; the write (on the device owner's
    thread) then only launches the donated update."""

    rank: int  # the rank the layout was padded to
    arrays: tuple  # put_slot_weights's (groups, scales, shifts)
    nbytes: int  # bytes on the devices, all of them together


def stage_slot(pool: LoRAMemoryPool, weights: dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]],
               terms: OutputTerms | None = None) -> StagedSlot:
    """Checks `weights` (LoRAAdapter.pool_weights) against the pool, moves them and the output
    `terms` to the devices, and waits until they are there: call it off the device owner's
    thread, so that a step never waits on an adapter's transfer."""
    rank = slot_rank(pool, weights)
    pool.class_for_rank(rank)  # refuses a rank wider than every class
    arrays = jax.block_until_ready(put_slot_weights(pool, weights, terms))
    return StagedSlot(rank, arrays, sum(x.nbytes for x in jax.tree.leaves(arrays)))


def write_slot(pool: LoRAMemoryPool, slot: int,
               weights: dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]] | StagedSlot,
               terms: OutputTerms | None = None) -> LoRAMemoryPool:
    """A pool with `slot` holding `weights` (LoRAAdapter.pool_weights at any rank up to the
    slot's class, or those staged on the devices by stage_slot) and, for a pool with room
    for output terms, the adapter's `terms` (None: a plain adapter; staged weights carry theirs);
    the slot's class buffers are donated.

    The slot index is traced, so every slot of a class shares one compiled update, and the
    donated buffers are updated in place: the write moves one adapter's bytes.
    """
    c = pool.class_of(slot)
    rc = pool.classes[c]
    if isinstance(weights, StagedSlot):
        if terms is not None:
            raise ValueError("staged slot weights carry their output terms; pass none beside them")
        rank, arrays = weights.rank, weights.arrays
    else:
        rank, arrays = slot_rank(pool, weights), None
    if rank > rc.rank:
        raise ValueError(f"slot weights of rank {rank} do not fit {slot=}, whose rank class holds rank {rc.rank}")
    if arrays is None:
        arrays = put_slot_weights(pool, weights, terms)
    fn = updater("write", rc.rows, _part_shardings(pool, c))
    part = fn(_part(pool, c), jnp.int32(slot - rc.first_slot), *arrays)
    return _with_part(pool, c, part)


def clear_slot(pool: LoRAMemoryPool, slot: int) -> LoRAMemoryPool:
    """A pool with `slot` all zero; its class's buffers are donated."""
    c = pool.class_of(slot)
    rc = pool.classes[c]
    fn = updater("clear", rc.rows, _part_shardings(pool, c))
    return _with_part(pool, c, fn(_part(pool, c), jnp.int32(slot - rc.first_slot)))


@functools.cache
def _saved_updater(module: str, out_sharding):
    """The jitted write of one saved-module slot, its table donated; the copy arrives as HF
    stores it ([vocab, hidden]) and lm_head's is transposed to the kernel layout here."""

    def put(table, index, weight):
        return table.at[index].set(weight.T if module == HEAD else weight)

    return jax.jit(put, donate_argnums=0, out_shardings=out_sharding)


def write_saved(pool: LoRAMemoryPool, module: str, index: int, weight: np.ndarray) -> LoRAMemoryPool:
    """A pool whose saved-module slot `index` of `module` holds `weight` ([vocab, hidden],
    HF's layout of both modules); that module's table is donated."""
    if not pool.has_saved(module):
        raise ValueError(f"the pool has no saved-module slots for {module!r} (it holds {list(pool.layout.saved)})")
    if not 0 <= index < pool.num_saved_slots:
        raise ValueError(f"saved-module slot {index} outside [0, {pool.num_saved_slots})")
    table = pool.saved_table(module)
    want = table.shape[1:] if module == EMBED else table.shape[:0:-1]
    if tuple(weight.shape) != tuple(want):
        raise ValueError(f"saved {module} has shape {tuple(weight.shape)}, the pool wants {tuple(want)}")
    vocab = TENSOR_AXIS if pool.layout.vocab_sharded else None
    w = jax.device_put(np.asarray(weight, pool.dtype), NamedSharding(pool.mesh, P(vocab, None)))
    i = pool.layout.saved.index(module)
    new = _saved_updater(module, table.sharding)(table, jnp.int32(index), w)
    return dataclasses.replace(pool, saved=pool.saved[:i] + (new,) + pool.saved[i + 1:])


def _check_slot(pool: LoRAMemoryPool, slot: int) -> None:
    if not 0 <= slot < pool.num_slots:
        raise ValueError(f"{slot=} outside [0, {pool.num_slots})")
