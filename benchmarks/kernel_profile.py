"""Where a LoRA layer's time goes on the GPU: launches, kernel run time, and the gaps between.

Each case is an unrolled chain of `layers` projections at the headline shape (T=64, S=64,
H=O=4096, r=16, bf16), as the model's layer loop runs them:
  empty       a one-block Pallas kernel that adds 1 in place: one launch, no work
  xla_op      one XLA elementwise op per layer (fusion kept apart by optimization barriers)
  shrink      the split-K shrink kernel alone (partials in tile layout)
  expand      the expand kernel alone, adding into the base output in place
  pair        shrink + expand, x and base distinct (as in the engine)
  pair_xh     the same with x and base one array (XLA must copy the base before the in-place
              expand; lora_kernels timed this way before 2026-11-30)
  single      the single-launch fused kernel
  gather      the XLA gather formulation; onehot: the one-hot einsum
Wall time is the median of a call over all layers. Device time comes from a profiler trace
(jax.profiler): the sum of kernel durations on the GPU's streams, and the kernel count, per
layer. Wall minus device is time the GPU sat between kernels (launch latency, host). With no
device trace (CPU, or a runtime where the profiler cannot read the GPU) those columns are n/a.

    python -m benchmarks.kernel_profile            # GPU
    python -m benchmarks.kernel_profile --smoke    # tiny shapes, interpret mode, any machine
Run it under different XLA_FLAGS (e.g. --xla_gpu_enable_command_buffer=+CUSTOM_CALL) to see
what CUDA-graph capture of the Pallas calls changes. Last line:
launch_floor_us=<f> pair_wall_us=<f> pair_device_us=<f> single_wall_us=<f> single_device_us=<f>
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from benchmarks import lora_kernels as lk
from kernels import xla
from kernels.bgmv import gpu
from kernels.bgmv.ops import block_sizes
from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.common import stacked_pool, tiles_from_slots

CASES = ("empty", "xla_op", "shrink", "expand", "pair", "pair_xh", "single", "gather", "onehot")


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + jnp.asarray(1, x_ref.dtype)


def empty_kernel(h: jax.Array, interpret: bool) -> jax.Array:
    """One launch of a trivial Pallas kernel on a [16, 128] corner of h, in place."""
    return pl.pallas_call(
        _add_one,
        grid=(1,),
        in_specs=[pl.BlockSpec((16, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((16, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
        input_output_aliases={0: 0},
        interpret=interpret,
        name="empty_add",
    )(h)


def case_fn(name: str, layers: int, bs: BlockSizes, single: BlockSizes, interpret: bool):
    """jit(f)(x, a, b, slots, scal, ranks) running `layers` projections of case `name`."""

    def run(x, a, b, slots, scal, ranks):
        num_slots = a.shape[1]
        meta = tiles_from_slots(slots, num_slots, bs.tm)
        meta1 = tiles_from_slots(slots, num_slots, single.tm)
        h = x
        outs = []
        for index in range(layers):
            (a_s, b_s), lyr = stacked_pool((a, b), index)
            if name == "empty":
                h = empty_kernel(h, interpret)
            elif name == "xla_op":
                h = lax.optimization_barrier(h * jnp.asarray(1.0001, h.dtype))
            elif name == "shrink":
                outs.append(gpu.shrink_partials(
                    x, a_s, lyr, ranks, meta, n_slices=1, tm=bs.tm, bk=bs.bk, num_splits=bs.num_splits,
                    num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret))
            elif name == "expand":
                v = jnp.full((x.shape[0], b.shape[2]), 0.01, jnp.float32)
                h = gpu.expand_add(v, (b_s,), lyr, (h,), scal, ranks, meta, v_in_tiles=False, tm=bs.tm, bn=bs.bn,
                                   num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret)[0]
            elif name in ("pair", "pair_xh"):
                parts = gpu.shrink_partials(
                    h if name == "pair_xh" else x, a_s, lyr, ranks, meta, n_slices=1, tm=bs.tm, bk=bs.bk,
                    num_splits=bs.num_splits, num_warps=bs.num_warps, num_stages=bs.num_stages,
                    interpret=interpret)
                h = gpu.expand_add(parts, (b_s,), lyr, (h,), scal, ranks, meta, v_in_tiles=True, tm=bs.tm,
                                   bn=bs.bn, num_warps=bs.num_warps, num_stages=bs.num_stages,
                                   interpret=interpret)[0]
            elif name == "single":
                h = gpu.lora_single_launch(
                    x, a_s, (b_s,), lyr, (h,), scal, ranks, meta1, tm=single.tm, bk=single.bk, bn=single.bn,
                    num_warps=single.num_warps, num_stages=single.num_stages, interpret=interpret)[0]
            elif name in ("gather", "onehot"):
                h = xla.lora(x, a[index], (b[index],), (h,), slots, scal, name)[0]
            else:
                raise ValueError(f"unknown case {name!r}; cases: {CASES}")
        return (h, *outs)

    return jax.jit(run)


def device_events(trace_dir: str) -> list[tuple[str, float]] | None:
    """(kernel name, duration ns) of every event on a GPU stream in the trace; None: no GPU plane."""
    from jax.profiler import ProfileData

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    events, saw_gpu = [], False
    for path in paths:
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            saw_gpu = True
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.name, float(e.duration_ns)) for e in line.events]
    return events if saw_gpu else None


def profile_case(f, args, *, layers: int, repeats: int, trace_runs: int) -> tuple[dict, jax.Array]:
    """Wall and device time per layer of one case (device side from a profiler trace), and its output."""
    wall = lk.bench(f, *args, repeats=repeats) / layers
    row = {"wall_us": wall * 1e6}
    out = f(*args)[0]
    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d):
                for _ in range(trace_runs):
                    jax.block_until_ready(f(*args))
            events = device_events(d)
        except Exception as e:  # the profiler may be unavailable on a runtime; wall time still counts
            row["trace_error"] = f"{type(e).__name__}: {e}"[:300]
            events = None
    if events is None:
        return row, out
    per = layers * trace_runs
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, ns in events:
        by_name[name][0] += 1
        by_name[name][1] += ns
    row["device_us"] = sum(ns for _, ns in events) / per / 1e3
    row["kernels_per_layer"] = len(events) / per
    row["gap_us"] = row["wall_us"] - row["device_us"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:6]
    row["top_kernels"] = [{"name": k[:80], "count_per_layer": c / per, "us_per_layer": ns / per / 1e3}
                          for k, (c, ns) in top]
    return row, out


def fmt(row: dict, key: str, width: int = 7) -> str:
    return f"{row[key]:{width}.2f}" if key in row else f"{'n/a':>{width}}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (any machine)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    smoke = args.smoke
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {CASES}")
    shape = lk.Shape(16, 8, 256, 16) if smoke else lk.Shape(**lk.HEADLINE)
    layers = args.layers or (2 if smoke else 16)
    repeats, trace_runs = (1, 1) if smoke else (30, 5)
    bs = block_sizes("gpu", shape.num_tokens, shape.hidden, jnp.bfloat16)
    single = BlockSizes(16, 256, 1024, single_launch=True) if not smoke else BlockSizes(16, 64, 128, single_launch=True)
    x, a, b, slots, scal, ranks = lk.make_stack(shape, layers, jnp.bfloat16, seed=7)
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"platform={jax.default_backend()} shape={shape} layers={layers} unrolled block={bs} "
          f"XLA_FLAGS={flags!r}", flush=True)
    rows, outputs = {}, {}
    print(f"{'case':8s} {'wall us':>7s} {'dev us':>7s} {'gap us':>7s} {'kern/L':>7s}  top kernel", flush=True)
    for name in cases:
        try:
            f = case_fn(name, layers, bs, single, interpret=smoke)
            row, outputs[name] = profile_case(f, (x, a, b, slots, scal, ranks), layers=layers,
                                              repeats=repeats, trace_runs=trace_runs)
        except Exception as e:  # one failing case must not hide the others
            row = {"error": f"{type(e).__name__}: {e}"[:500]}
        rows[name] = row
        top = row.get("top_kernels", [{}])[0].get("name", row.get("error", row.get("trace_error", "")))[:60]
        print(f"{name:8s} {fmt(row, 'wall_us')} {fmt(row, 'device_us')} {fmt(row, 'gap_us')} "
              f"{fmt(row, 'kernels_per_layer')}  {top}", flush=True)
    if "gather" in outputs:  # pair and single compute what gather does: a check that the timed code is right
        ref = np.asarray(outputs["gather"], np.float32)
        for name in ("pair", "single"):
            if name in outputs:
                got = np.asarray(outputs[name], np.float32)
                rows[name]["relerr_vs_gather"] = float(np.linalg.norm(got - ref) / (np.linalg.norm(ref) + 1e-12))
                print(f"{name} vs gather: relative error {rows[name]['relerr_vs_gather']:.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"shape": vars(shape), "layers": layers, "xla_flags": flags, "rows": rows}, fh, indent=1)

    def val(case, key):
        return rows.get(case, {}).get(key, float("nan"))
    print(f"launch_floor_us={val('empty', 'wall_us'):.2f} pair_wall_us={val('pair', 'wall_us'):.2f} "
          f"pair_device_us={val('pair', 'device_us'):.2f} single_wall_us={val('single', 'wall_us'):.2f} "
          f"single_device_us={val('single', 'device_us'):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
