"""Merging adapters into a new one, as PEFT's ``add_weighted_adapter`` does.

A merge takes adapters of one base model, a weight each and a combination type, and makes
a plain LoRA adapter (PEFT's two files) that is then registered and served like any other.
The combination types are PEFT's, with its arithmetic (``peft/tuners/lora/model.py``,
``peft/utils/merge_utils.py``); ``s_i`` is adapter i's scaling of the module:

- ``cat``: A = [w_1 s_1 A_1; ...; w_n s_n A_n], B = [B_1 ... B_n]. Exact: the merged delta is
  the weighted sum of the adapters' deltas; its rank is the sum of theirs.
- ``svd``: the weighted sum of the deltas, cut to ``svd_rank`` (default: the largest rank
  of the adapters) by its singular value decomposition. PEFT decomposes the dense out × in
  delta; here the SVD is taken of the thin factors (see ``_svd``), which gives the same delta
  in milliseconds per module where a dense SVD of a 14336 × 4096 module takes tens of seconds.
- ``linear``, ``ties``, ``dare_linear``, ``dare_ties``, ``magnitude_prune``: task arithmetic on the
  A and on the B factors separately, weighted by sqrt(|w_i s_i|) (A also by the sign of
  w_i s_i). It needs equal ranks and is an approximation: A_sum B_sum has cross terms.
  TIES prunes each factor to its ``density`` largest magnitudes and keeps, per entry,
  the values of the majority sign (``majority_sign_method``: by summed value, "total", or
  by count, "frequency"), averaging them; DARE drops entries at random (kept with
  probability ``density``, rescaled by 1 / density), from a generator seeded by ``seed``
  so a merge is reproducible.

The merged adapter has one rank r for every module (modules of lower rank are padded with
zeros, which changes nothing), ``lora_alpha = r`` (scaling 1, the adapters' scalings are in
the weights) and targets the union of the adapters' modules; a module only some adapters
target merges those. PEFT's dense-pruned SVD types (``ties_svd``, ...) are refused: they
need a dense SVD per module at served widths, minutes per adapter. Adapters with DoRA
magnitudes, lora_B biases or modules_to_save copies are refused: PEFT cannot merge them
either (it refuses modules_to_save, and would drop the others silently).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from lora_runtime.errors import InvalidRequestError
from lora_runtime.lora.adapter import EMBED, NO_LAYER, LoRAAdapter, module_path, tensor_key

FACTOR_TYPES = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")
COMBINATION_TYPES = ("svd", "cat") + FACTOR_TYPES
_DENSITY_TYPES = ("ties", "dare_linear", "dare_ties", "magnitude_prune")
_SIGN_METHODS = ("total", "frequency")
# Adapters in one merge: the admin actor holds them all while it merges (16 rank-64
# Llama-3-8B adapters in bf16 are 2.7 GB).
MAX_MERGED = 16


@dataclasses.dataclass(frozen=True)
class MergeSpec:
    """What to merge and how; checked on construction (InvalidRequestError naming the field)."""

    adapters: tuple[str, ...]
    weights: tuple[float, ...]
    combination_type: str = "svd"
    svd_rank: int | None = None
    density: float | None = None
    majority_sign_method: str = "total"
    seed: int = 0

    def __post_init__(self):
        field = "merge."
        if not self.adapters or len(self.adapters) > MAX_MERGED:
            raise InvalidRequestError(f"merge.adapters must name 1 to {MAX_MERGED} adapters, got "
                                      f"{len(self.adapters)}", param=field + "adapters")
        if len(set(self.adapters)) != len(self.adapters):
            twice = sorted({a for a in self.adapters if self.adapters.count(a) > 1})
            raise InvalidRequestError(f"merge.adapters lists {twice} more than once; give each adapter one weight",
                                      param=field + "adapters")
        if len(self.weights) != len(self.adapters):
            raise InvalidRequestError(f"merge.weights has {len(self.weights)} weights for {len(self.adapters)} "
                                      "adapters; give one weight per adapter", param=field + "weights")
        for w in self.weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise InvalidRequestError(f"merge.weights holds {w!r}; weights must be finite numbers",
                                          param=field + "weights")
        if self.combination_type not in COMBINATION_TYPES:
            hint = (" (PEFT's dense-pruned SVD types are not supported: they need a dense SVD of every module)"
                    if str(self.combination_type).endswith("_svd") else "")
            raise InvalidRequestError(f"merge.combination_type={self.combination_type!r} is not one of "
                                      f"{list(COMBINATION_TYPES)}{hint}", param=field + "combination_type")
        if self.svd_rank is not None:
            if self.combination_type != "svd":
                raise InvalidRequestError(f"merge.svd_rank applies to combination_type 'svd', not "
                                          f"{self.combination_type!r}", param=field + "svd_rank")
            if isinstance(self.svd_rank, bool) or not isinstance(self.svd_rank, int) or self.svd_rank <= 0:
                raise InvalidRequestError(f"merge.svd_rank={self.svd_rank!r} must be a positive integer",
                                          param=field + "svd_rank")
        if self.combination_type in _DENSITY_TYPES:
            d = self.density
            if (d is not None or len(self.adapters) > 1) and (
                    isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1):
                raise InvalidRequestError(f"merge.density={d!r}: combination_type {self.combination_type!r} needs "
                                          "the fraction of values to keep, in (0, 1]", param=field + "density")
        elif self.density is not None:
            raise InvalidRequestError(f"merge.density applies to {list(_DENSITY_TYPES)}, not "
                                      f"{self.combination_type!r}", param=field + "density")
        if self.majority_sign_method not in _SIGN_METHODS:
            raise InvalidRequestError(f"merge.majority_sign_method={self.majority_sign_method!r} is not one of "
                                      f"{list(_SIGN_METHODS)}", param=field + "majority_sign_method")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidRequestError(f"merge.seed={self.seed!r} must be a non-negative integer", param=field + "seed")

    @classmethod
    def from_dict(cls, d: Mapping) -> MergeSpec:
        return cls(adapters=tuple(d["adapters"]), weights=tuple(d["weights"]),
                   **{k: d[k] for k in ("combination_type", "svd_rank", "density", "majority_sign_method", "seed")
                      if d.get(k) is not None})

    @property
    def effective_type(self) -> str:
        # PEFT merges a single adapter linearly, whatever type is asked (exact for one).
        return "linear" if len(self.adapters) == 1 else self.combination_type

    def record(self) -> dict:
        """The merge as the registry records it."""
        out = {"adapters": list(self.adapters), "weights": [float(w) for w in self.weights],
               "combination_type": self.combination_type}
        for k in ("svd_rank", "density"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.effective_type in ("ties", "dare_ties"):
            out["majority_sign_method"] = self.majority_sign_method
        if self.effective_type.startswith("dare"):
            out["seed"] = self.seed
        return out


@dataclasses.dataclass(frozen=True)
class MergedFiles:
    """A merged adapter's two PEFT files."""

    config_json: bytes
    safetensors: bytes
    rank: int


def merge_adapters(spec: MergeSpec, adapters: Sequence[LoRAAdapter], num_layers: int,
                   max_lora_rank: int) -> MergedFiles:
    """The merged adapter's files; InvalidRequestError naming what cannot be merged."""
    from safetensors.numpy import save

    for a in adapters:
        why = ("DoRA magnitudes (use_dora)" if a.use_dora else "lora_B biases (lora_bias)" if a.has_bias
               else "modules_to_save copies" if a.saved_modules else None)
        if why:
            raise InvalidRequestError(f"adapter {a.name!r} has {why}, which a merge cannot combine; merge plain "
                                      "LoRA adapters", param="merge.adapters")
    kind = spec.effective_type
    weights = [float(w) for w in spec.weights]
    rng = np.random.default_rng(spec.seed)
    keys = sorted(set().union(*(a.modules for a in adapters)))
    dtype = np.result_type(*(w.a.dtype for a in adapters for w in a.weights.values()),
                           *(w.b.dtype for a in adapters for w in a.weights.values()))
    svd_rank = spec.svd_rank or max(a.rank for a in adapters)
    merged = {}
    for key in keys:
        parts = [(a.weights[key], a.scaling * a.weights[key].ratio, w) for a, w in zip(adapters, weights)
                 if key in a.weights]
        if kind == "cat":
            merged[key] = _cat(parts)
        elif kind == "svd":
            merged[key] = _svd(parts, svd_rank)
        else:
            ranks = sorted({m.a.shape[0] for m, _, _ in parts})
            if len(ranks) > 1:
                raise InvalidRequestError(
                    f"combination_type {kind!r} needs equal ranks, but the adapters' ranks of module "
                    f"{module_path(*key)!r} are {ranks}; use 'svd' or 'cat'", param="merge.combination_type")
            merged[key] = _factor_merge(kind, parts, spec.density, spec.majority_sign_method, rng)
    rank = max(1, *(a.shape[0] for a, _ in merged.values()))  # 0 only for a delta of zero
    if rank > max_lora_rank:
        how = {"cat": " (combination_type 'cat' adds the ranks; 'svd' with svd_rank cuts them)",
               "svd": " (lower svd_rank)"}.get(kind, "")
        raise InvalidRequestError(f"the merged adapter's rank {rank} exceeds this server's max_lora_rank="
                                  f"{max_lora_rank}{how}", param="merge")
    tensors = {}
    for key, (a, b) in merged.items():
        pad = rank - a.shape[0]
        tensors[tensor_key(key, "A")] = np.ascontiguousarray(np.pad(a, ((0, pad), (0, 0))).astype(dtype))
        tensors[tensor_key(key, "B")] = np.ascontiguousarray(np.pad(b, ((0, 0), (0, pad))).astype(dtype))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": _target_modules(merged.keys(), num_layers), "lora_dropout": 0.0, "bias": "none",
              "use_rslora": False, "use_dora": False, "lora_bias": False, "fan_in_fan_out": False,
              "inference_mode": True}
    return MergedFiles(config_json=json.dumps(config, indent=1).encode(), safetensors=save(tensors), rank=rank)


def _target_modules(keys, num_layers: int) -> list[str]:
    """Module names selecting exactly ``keys``: a short name for a module merged in every
    layer, full paths otherwise."""
    out = []
    for module in sorted({m for _, m in keys}):
        layers = {layer for layer, m in keys if m == module}
        if layers == {NO_LAYER}:
            out.append("model.embed_tokens" if module == EMBED else module)
        elif layers == set(range(num_layers)):
            out.append(module)
        else:
            out += [module_path(layer, module) for layer in sorted(layers)]
    return out


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _cat(parts) -> tuple[np.ndarray, np.ndarray]:
    a = np.concatenate([_f64(m.a) * (w * s) for m, s, w in parts], axis=0)
    b = np.concatenate([_f64(m.b) for m, _, _ in parts], axis=1)
    return a, b


def _svd(parts, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The weighted sum of the parts' deltas, B A, cut to ``rank`` singular values:
    B = U S, A = V^T as PEFT returns them. With B = Qb Rb and A^T = Qa Ra (Q orthonormal),
    B A = Qb (Rb Ra^T) Qa^T, so the SVD of the small Rb Ra^T gives B A's. Rb comes from the
    eigendecomposition of B^T B (R × R; Rb = Λ^½ V^T, Qb = B V Λ^-½), which costs two thin
    products where a QR of the tall B costs ten times more; directions whose singular value
    is under 1e-7 of the largest (below the merged weights' precision) are dropped."""
    a, b = _cat(parts)  # b @ a is the exact sum
    (vals_b, vecs_b), (vals_a, vecs_a) = np.linalg.eigh(b.T @ b), np.linalg.eigh(a @ a.T)
    keep_b, keep_a = vals_b > vals_b.max(initial=0.0) * 1e-14, vals_a > vals_a.max(initial=0.0) * 1e-14
    if not keep_b.any() or not keep_a.any():  # a zero delta
        return np.zeros((0, a.shape[1])), np.zeros((b.shape[0], 0))
    vals_b, vecs_b, vals_a, vecs_a = vals_b[keep_b], vecs_b[:, keep_b], vals_a[keep_a], vecs_a[:, keep_a]
    small = (np.sqrt(vals_b)[:, None] * vecs_b.T) @ (vecs_a * np.sqrt(vals_a))
    u, s, vt = np.linalg.svd(small)
    k = min(rank, s.shape[0])
    new_b = b @ ((vecs_b / np.sqrt(vals_b)) @ (u[:, :k] * s[:k]))
    new_a = ((vt[:k] / np.sqrt(vals_a)) @ vecs_a.T) @ a
    return new_a, new_b


def _factor_merge(kind: str, parts, density, sign_method: str, rng) -> tuple[np.ndarray, np.ndarray]:
    scaled = [w * s for _, s, w in parts]
    weights_a = np.array([math.copysign(math.sqrt(abs(x)), x) for x in scaled])
    weights_b = np.array([math.sqrt(abs(x)) for x in scaled])
    a = combine(kind, [_f64(m.a) for m, _, _ in parts], weights_a, density, sign_method, rng)
    b = combine(kind, [_f64(m.b) for m, _, _ in parts], weights_b, density, sign_method, rng)
    return a, b


def combine(kind: str, tensors: list[np.ndarray], weights: np.ndarray, density: float | None,
            sign_method: str = "total", rng: np.random.Generator | None = None) -> np.ndarray:
    """PEFT's task-arithmetic merge of same-shaped ``tensors`` (merge_utils: task_arithmetic,
    ties, dare_linear, dare_ties, magnitude_prune)."""
    if kind in ("ties", "magnitude_prune"):
        tensors = [prune_magnitude(t, density) for t in tensors]
    elif kind in ("dare_linear", "dare_ties"):
        tensors = [prune_random(t, density, rng) for t in tensors]
    stacked = np.stack(tensors)
    weighted = stacked * weights.reshape((-1,) + (1,) * (stacked.ndim - 1))
    if kind not in ("ties", "dare_ties"):
        return weighted.sum(axis=0)
    signs = np.sign(stacked)
    magnitude = stacked.sum(axis=0) if sign_method == "total" else signs.sum(axis=0)
    keep = signs == np.where(magnitude >= 0, 1.0, -1.0)
    return (weighted * keep).sum(axis=0) / np.maximum(keep.sum(axis=0), 1)


def prune_magnitude(t: np.ndarray, density: float | None) -> np.ndarray:
    """``t`` with all but its int(density × size) largest magnitudes zeroed."""
    if density is None or density >= 1:
        return t
    k = int(density * t.size)
    flat = np.abs(t).reshape(-1)
    mask = np.zeros(t.size, dtype=bool)
    if k > 0:
        mask[np.argpartition(flat, t.size - k)[t.size - k:]] = True
    return t * mask.reshape(t.shape)


def prune_random(t: np.ndarray, density: float | None, rng: np.random.Generator) -> np.ndarray:
    """DARE: each entry kept with probability ``density`` and rescaled by 1 / density."""
    if density is None or density >= 1:
        return t
    return t * (rng.random(t.shape) < density) / density


__all__ = ["COMBINATION_TYPES", "MergeSpec", "MergedFiles", "combine", "merge_adapters", "prune_magnitude",
           "prune_random"]
