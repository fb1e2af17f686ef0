"""How long merging adapters takes at Llama-3-8B widths, against PEFT's dense SVD.

    python -m benchmarks.merge [--quick] [--layers N] [--rank R] [--adapters K]

Makes K random rank-R bf16 adapters on all 7 projections of a Llama-3-8B-shaped model
(hidden 4096, intermediate 14336, 8 kv heads of 128) with `--layers` layers, and times
`merge_adapters` (what the admin actor runs for a registration with `merge`) for each
combination type, files included; per layer and scaled to 32 layers (the work is per
module, so it grows linearly with depth).

PEFT's `svd` merge decomposes each module's dense out × in delta. The last row times that:
one dense SVD as PEFT runs it (torch.linalg.svd, f32, full matrices) per distinct module
shape, summed over a layer's 7 modules and scaled to 32 layers (`--quick` times only the
smallest shape and leaves the row out). It also checks that the factored SVD's delta equals
the dense one's, cut to the same rank. Last line:
`svd_merge_s_32_layers=<f> cat_merge_s_32_layers=<f> ties_merge_s_32_layers=<f> dense_svd_s_32_layers=<f> speedup_vs_dense=<f>`.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from benchmarks.common import print_table, synthetic_config
from lora_runtime.lora.adapter import LoRAAdapter, ModuleWeights, module_shapes
from lora_runtime.lora.merge import MergeSpec, merge_adapters

SHAPE = dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
DEPTH = 32
TYPES = (("svd", {}), ("cat", {}), ("linear", {}), ("ties", {"density": 0.5}), ("dare_ties", {"density": 0.5}))


def _adapters(config, rank: int, count: int) -> list[LoRAAdapter]:
    rng = np.random.default_rng(0)
    shapes = module_shapes(config)
    out = []
    for i in range(count):
        weights = {}
        for layer in range(config.num_layers):
            for module, (fan_in, fan_out) in shapes.items():
                a = rng.standard_normal((rank, fan_in), dtype=np.float32) / np.float32(np.sqrt(fan_in))
                b = rng.standard_normal((fan_out, rank), dtype=np.float32) * np.float32(0.01)
                weights[layer, module] = ModuleWeights(a=a.astype(ml_dtypes.bfloat16), b=b.astype(ml_dtypes.bfloat16),
                                                       ratio=1.0)
        out.append(LoRAAdapter(name=f"a{i}", rank=rank, scaling=2.0, weights=weights))
    return out


def _dense_svd_s(shape: tuple[int, int], rank: int) -> float:
    """Seconds of the SVD PEFT's svd merge runs on one module's dense delta: torch.linalg.svd,
    f32, full_matrices=True (its default)."""
    import torch

    dense = torch.randn(shape[0], 2 * rank) @ torch.randn(2 * rank, shape[1])
    t = time.perf_counter()
    torch.linalg.svd(dense, full_matrices=True)
    return time.perf_counter() - t


def _check_against_dense(adapters: list[LoRAAdapter], weights: list[float], rank: int) -> float:
    """Relative difference of the factored and the dense rank-``rank`` SVD of one module's sum."""
    from lora_runtime.lora.merge import _svd

    key = (0, "k_proj")
    parts = [(a.weights[key], a.scaling, w) for a, w in zip(adapters, weights)]
    want = sum(w * s * (m.b.astype(np.float64) @ m.a.astype(np.float64)) for m, s, w in parts)
    u, s, vt = np.linalg.svd(want, full_matrices=False)
    dense = (u[:, :rank] * s[:rank]) @ vt[:rank]
    a, b = _svd(parts, rank)
    return float(np.linalg.norm(b @ a - dense) / np.linalg.norm(dense))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--adapters", type=int, default=2)
    args = p.parse_args()
    layers = args.layers or (1 if args.quick else 2)
    config = synthetic_config(layers=layers, **SHAPE)
    adapters = _adapters(config, args.rank, args.adapters)
    weights = [1.0 / (i + 1) for i in range(args.adapters)]
    names = tuple(a.name for a in adapters)
    rows, per_type = [], {}
    for kind, options in TYPES:
        spec = MergeSpec(adapters=names, weights=tuple(weights), combination_type=kind, **options)
        t = time.perf_counter()
        files = merge_adapters(spec, adapters, layers, max_lora_rank=args.rank * args.adapters)
        s = time.perf_counter() - t
        per_type[kind] = s / layers * DEPTH
        rows.append((kind, files.rank, round(len(files.safetensors) / 2**20 / layers, 1), round(s / layers, 3),
                     round(per_type[kind], 1)))
    shapes = module_shapes(config)
    distinct = sorted({(o, i) for i, o in shapes.values()})
    timed = distinct[:1] if args.quick else distinct
    svd_s = {shape: _dense_svd_s(shape, args.rank) for shape in timed}
    dense_layer = sum(svd_s[(o, i)] for i, o in shapes.values()) if not args.quick else float("nan")
    if not args.quick:
        rows.append(("dense svd (PEFT)", args.rank, "", round(dense_layer, 3), round(dense_layer * DEPTH, 1)))
    print(f"{args.adapters} adapters of rank {args.rank}, bf16, all 7 projections, {layers} layer(s) of "
          f"Llama-3-8B widths; dense SVD per shape: " + ", ".join(f"{o}x{i} {t:.2f} s" for (o, i), t in svd_s.items()))
    print(f"factored vs dense rank-{args.rank} SVD of k_proj's sum: relative difference "
          f"{_check_against_dense(adapters, weights, args.rank):.2e}")
    print_table(("combination", "rank", "MiB/layer", "s/layer", f"s/{DEPTH} layers"), rows)
    dense_total = dense_layer * DEPTH
    print(f"svd_merge_s_32_layers={per_type['svd']:.2f} cat_merge_s_32_layers={per_type['cat']:.2f} "
          f"ties_merge_s_32_layers={per_type['ties']:.2f} dense_svd_s_32_layers={dense_total:.1f} "
          f"speedup_vs_dense={dense_total / per_type['svd']:.1f}")


if __name__ == "__main__":
    main()
