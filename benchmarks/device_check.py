"""One-shot accelerator check of the LoRA kernels: correctness, tuning, benchmark, 32-layer stack.

Run on the accelerator machine from the repository root (no Ray needed):
    python benchmarks/device_check.py            # about 4-5 minutes on an H200
    python benchmarks/device_check.py --cpu-smoke  # tiny shapes, interpret mode, any machine
    python benchmarks/device_check.py --cpu-smoke --platform tpu  # the TPU kernels, interpreted
The kernels checked are the machine's (Triton on a GPU, Mosaic on a TPU; --platform picks
them in smoke mode, where they run interpreted).
Sections (each fails soft: an error is printed and recorded, the script goes on):
  1. env         jax version, device, a trivial Pallas kernel for the platform
  2. correctness bgmv / sgmv / shrink+expand / backend on the device (non-interpret)
                 against a float64 numpy reference, over a compact matrix;
                 paged attention (the platform's kernel) against the dense reference
  3. sweep       block sizes of the kernel on the headline shape (T=64, S=64, 4096, r=16)
  4. benchmark   benchmarks.lora_kernels shapes: kernel vs one-hot vs gather, bandwidth
  5. stack       the 32-layer stack of one 4096x4096 bf16 projection with rank-16 LoRA:
                 base, one-hot, gather, sort+ragged_dot and the kernel, ratio over base
                 against the byte roofline ratio
JSON details go to $OUT/device_check.json (default ./.device_out), rewritten after every
section; a short table and the targets are printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

START = time.perf_counter()  # the time budget counts the jax import and device start too
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks import lora_kernels as lk  # noqa: E402
from kernels import xla  # noqa: E402
from kernels.bgmv import bgmv, bgmv_expand, bgmv_shrink  # noqa: E402
from kernels.bgmv.ops import bgmv_metadata, block_sizes  # noqa: E402
from kernels.bgmv.tuned_block_sizes import BlockSizes  # noqa: E402
from kernels.common import default_platform, gpu_lowering_target  # noqa: E402
from kernels.sgmv import sgmv  # noqa: E402
from lora_runtime.lora.batch_info import build_batch_info  # noqa: E402

# What the imports above took: the budget counts them, but not time the importing process
# spent on other work before calling main() (a test suite importing this module early).
IMPORT_SECONDS = time.perf_counter() - START

TOL = {"float32": (1e-3, 1e-3), "bfloat16": (3e-2, 3e-2)}  # rtol, atol as a fraction of max |ref|


class Run:
    """Shared state: options, the JSON record, the time budget."""

    def __init__(self, args):
        self.smoke = args.cpu_smoke
        # The kernel path under test: the machine's, or --platform's (interpreted in smoke mode).
        machine = default_platform()
        self.platform = args.platform or (machine if machine != "cpu" else "gpu")
        self.interpret = self.smoke
        self.t0 = time.perf_counter() - IMPORT_SECONDS
        self.budget = args.budget_s
        self.hard_limit = args.budget_s + 20
        self.out_dir = Path(args.out or os.environ.get("OUT") or "./.device_out")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.record: dict = {"argv": sys.argv[1:], "smoke": self.smoke, "sections": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self, what: str) -> bool:
        """True (and says so) once the hard limit is near: later rows are dropped, not run."""
        if self.elapsed() < self.hard_limit:
            return False
        print(f"  stopping {what}: {self.elapsed():.0f}s elapsed, hard limit {self.hard_limit:.0f}s", flush=True)
        return True

    def save(self) -> None:
        path = self.out_dir / "device_check.json"
        path.write_text(json.dumps(self.record, indent=1, default=str))

    def section(self, name: str, fn, min_left_s: float) -> None:
        left = self.budget - self.elapsed()
        if left < min_left_s:
            print(f"[{name}] skipped: {left:.0f}s of budget left, needs {min_left_s:.0f}s", flush=True)
            self.record["sections"][name] = {"skipped": f"budget ({left:.0f}s left)"}
            self.save()
            return
        print(f"[{name}] start at {self.elapsed():.0f}s", flush=True)
        t = time.perf_counter()
        try:
            self.record["sections"][name] = fn(self)
        except Exception as e:  # a broken section must not stop the others
            traceback.print_exc()
            self.record["sections"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        self.record["sections"][name + "_seconds"] = time.perf_counter() - t
        print(f"[{name}] done in {time.perf_counter() - t:.0f}s", flush=True)
        self.save()


def bench(fn, *args, repeats: int) -> float:
    return lk.bench(fn, *args, repeats=repeats)


# ---------------------------------------------------------------- 1. environment


def section_env(run: Run) -> dict:
    from jax.experimental import pallas as pl

    info = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "platform": run.platform}
    print(f"  jax {info['jax']} backend {info['backend']} devices {info['devices']} kernels {run.platform}",
          flush=True)

    def add(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    if run.platform == "gpu":
        from jax.experimental.pallas import triton as plgpu

        xs = jnp.arange(1024, dtype=jnp.float32)
        kw = dict(compiler_params=plgpu.CompilerParams(num_warps=4), interpret=run.interpret)
    else:
        from kernels.sgmv.tpu import interpret_params

        xs = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
        kw = dict(interpret=interpret_params(run.interpret))
    r = pl.pallas_call(add, out_shape=jax.ShapeDtypeStruct(xs.shape, xs.dtype), **kw)(xs, xs)
    info["add_kernel_ok"] = bool(np.allclose(np.asarray(r), 2 * np.asarray(xs)))
    print(f"  {run.platform} add kernel ok: {info['add_kernel_ok']}", flush=True)
    return info


# ---------------------------------------------------------------- 2. correctness


def ref_lora(x, a, b, base, slots, scal):
    """float64 numpy, one slot at a time: y_i[t] = base_i[t] + scal[s] * (x[t] @ A_i[s]ᵀ) @ B_i[s]."""
    x64 = np.asarray(x, np.float64)
    slots = np.asarray(slots)
    rank = b[0].shape[1]
    v = np.zeros((x64.shape[0], a.shape[1]))
    outs = [np.asarray(y, np.float64).copy() for y in base]
    for s in np.unique(slots[slots >= 0]).tolist():
        toks = np.flatnonzero(slots == s)
        v[toks] = (x64[toks] @ np.asarray(a[s], np.float64).T) * float(scal[s])
        for i, bi in enumerate(b):
            outs[i][toks] += v[toks, i * rank : (i + 1) * rank] @ np.asarray(bi[s], np.float64)
    return v, outs


def max_violation(got, want, dtype) -> float:
    """max(|got - want| / (atol + rtol |want|)); <= 1 passes."""
    rtol, atol_frac = TOL[jnp.dtype(dtype).name]
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    atol = atol_frac * max(float(np.abs(want).max(initial=0.0)), 1.0)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float((np.abs(got - want) / (atol + rtol * np.abs(want))).max(initial=0.0))


def make_case(t, s, r, outs, in_f, dtype, seed, slots=None, ranks=None):
    rng = np.random.default_rng(seed)
    n = len(outs)
    ranks = rng.integers(1, r + 1, size=s) if ranks is None else np.asarray(ranks)
    slots = rng.integers(-1, s, size=t) if slots is None else np.asarray(slots)
    rows = (np.arange(r)[None, :] < ranks[:, None]).astype(np.float32)
    a = rng.normal(size=(s, n * r, in_f)).astype(np.float32) * 0.05 * np.tile(rows, (1, n))[:, :, None]
    b = [rng.normal(size=(s, r, o)).astype(np.float32) * 0.05 * rows[:, :, None] for o in outs]
    x = rng.normal(size=(t, in_f)).astype(np.float32)
    base = [rng.normal(size=(t, o)).astype(np.float32) for o in outs]
    scal = rng.uniform(0.5, 2.0, size=s).astype(np.float32)

    def cast(z):
        return jnp.asarray(z, dtype)

    dev = dict(x=cast(x), a=cast(a), b=tuple(cast(z) for z in b), base=tuple(cast(z) for z in base),
               slots=jnp.asarray(slots, jnp.int32), scal=jnp.asarray(scal), ranks=jnp.asarray(ranks, jnp.int32))
    # The reference sees the same (rounded) inputs as the device.
    def to_host(z):
        z = np.asarray(z)
        return z if np.issubdtype(z.dtype, np.integer) else z.astype(np.float32)

    host = {k: tuple(map(to_host, v)) if isinstance(v, tuple) else to_host(v) for k, v in dev.items()}
    return dev, host


def correctness_cases(smoke: bool, platform: str = "gpu"):
    """(name, T, S, R, outs, in, dtype, op, extra) — a compact pairwise matrix (each platform's
    own kernel variant only there: the GPU's one launch, the TPU's slot loop)."""
    cases = _correctness_cases(smoke)
    other = "slot_loop" if platform == "gpu" else "single_launch"
    return [c for c in cases if not getattr(c[-1].get("block", BlockSizes(1, 1, 1)), other)]


def _correctness_cases(smoke: bool):
    bf, f32 = jnp.bfloat16, jnp.float32
    if smoke:
        qkv, hid = (64, 32, 32), 64
        return [
            ("bgmv_qkv_T7", 7, 4, 8, qkv, hid, bf, "bgmv", {}),
            ("bgmv_T16_f32", 16, 4, 16, (64,), hid, f32, "bgmv", {}),
            ("halves_T9", 9, 4, 8, qkv, hid, bf, "halves", {}),
            ("sgmv_T40", 40, 4, 8, (64, 64), hid, bf, "sgmv", {}),
            ("backend_qkv", 12, 4, 8, qkv, hid, bf, "backend", {}),
            ("no_adapter", 16, 4, 8, (64,), hid, bf, "bgmv", {"slots": [-1] * 16}),
            ("single_launch", 12, 4, 8, qkv, hid, bf, "bgmv", {"block": BlockSizes(16, 32, 32, single_launch=True)}),
            ("slot_loop", 12, 4, 8, qkv, hid, bf, "bgmv", {"block": BlockSizes(16, 1 << 16, 128, slot_loop=2)}),
        ]
    qkv, hid, inter = (4096, 1024, 1024), 4096, 14336
    return [
        ("bgmv_T1_S1_r16_o", 1, 1, 16, (4096,), hid, bf, "bgmv", {}),
        ("bgmv_T7_S4_r8_qkv", 7, 4, 8, qkv, hid, bf, "bgmv", {}),
        ("bgmv_T16_S32_r64_gateup", 16, 32, 64, (inter, inter), hid, bf, "bgmv", {}),
        ("bgmv_T64_S64_r16_qkv", 64, 64, 16, qkv, hid, bf, "bgmv", {}),
        ("bgmv_T100_S4_r4_down", 100, 4, 4, (4096,), inter, bf, "bgmv", {}),
        ("bgmv_T37_S8_r16_f32", 37, 8, 16, (4096, 512, 512), 3584, f32, "bgmv", {}),
        ("bgmv_T256_S256_r16", 256, 256, 16, (4096,), hid, bf, "bgmv", {}),
        ("bgmv_no_adapter", 64, 8, 16, (4096,), hid, bf, "bgmv", {"slots": [-1] * 64}),
        ("bgmv_one_adapter", 64, 8, 16, (4096,), hid, bf, "bgmv", {"slots": [3] * 64}),
        ("bgmv_ragged_mixed_ranks", 48, 6, 16, qkv, hid, bf, "bgmv",
         {"slots": [0] + [5] * 17 + [2] * 3 + [-1] * 27, "ranks": [16, 1, 8, 4, 2, 16]}),
        ("halves_T33_S8_qkv", 33, 8, 16, qkv, hid, bf, "halves", {}),
        ("sgmv_T512_S8_r16_qkv", 512, 8, 16, qkv, hid, bf, "sgmv", {}),
        ("sgmv_T100_S4_r8_f32", 100, 4, 8, (448, 64, 64), 3584, f32, "sgmv", {}),
        ("sgmv_T1024_S4_r16_down", 1024, 4, 16, (4096,), inter, bf, "sgmv", {}),
        ("backend_qkv_decode", 24, 8, 16, qkv, hid, bf, "backend", {}),
        ("single_launch_T64_S64_qkv", 64, 64, 16, qkv, hid, bf, "bgmv",
         {"block": BlockSizes(16, 256, 256, single_launch=True)}),
        ("single_launch_T37_f32_mixed", 37, 8, 16, (4096, 512, 512), 3584, f32, "bgmv",
         {"block": BlockSizes(16, 256, 512, single_launch=True), "ranks": [16, 1, 8, 4, 2, 16, 3, 0]}),
        ("slot_loop_T64_S64_qkv", 64, 64, 16, qkv, hid, bf, "bgmv",
         {"block": BlockSizes(16, 1 << 16, 16384, slot_loop=4)}),
        ("slot_loop_T37_f32_mixed", 37, 8, 16, (4096, 512, 512), 3584, f32, "bgmv",
         {"block": BlockSizes(16, 1 << 16, 16384, slot_loop=2), "ranks": [16, 1, 8, 4, 2, 16, 3, 0]}),
        ("slot_loop_T256_S256_r64_gateup", 256, 256, 64, (inter, inter), hid, bf, "bgmv",
         {"block": BlockSizes(16, 1 << 16, 16384, slot_loop=4)}),
        ("slot_loop_T32_S63_head259", 32, 63, 16, (259,), hid, bf, "bgmv",  # an lm_head of the demo vocabulary
         {"block": BlockSizes(16, 1 << 16, 16384, slot_loop=4)}),
        ("slot_loop_sgmv_T512_S8_qkv", 512, 8, 16, qkv, hid, bf, "sgmv",  # prompt rows in tiles of 128
         {"block": BlockSizes(128, 1 << 16, 4096, slot_loop=4)}),
        ("slot_loop_sgmv_T1024_S4_down", 1024, 4, 16, (4096,), inter, bf, "sgmv",
         {"block": BlockSizes(128, 1 << 16, 4096, slot_loop=4)}),
    ]


def run_correctness_case(run: Run, name, t, s, r, outs, in_f, dtype, op, extra) -> dict:
    extra = dict(extra)
    block = extra.pop("block", None)
    dev, host = make_case(t, s, r, outs, in_f, dtype, seed=t * 31 + s, **extra)
    kw = dict(platform=run.platform, interpret=run.interpret, block=block)
    v_ref, y_ref = ref_lora(host["x"], host["a"], host["b"], host["base"], host["slots"], host["scal"])
    row: dict = {"case": name, "T": t, "S": s, "R": r, "outs": list(outs), "in": in_f,
                 "dtype": jnp.dtype(dtype).name, "op": op}
    if op == "bgmv":
        f = jax.jit(lambda d: bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scal"], d["ranks"], **kw))
        ys = f(dev)
    elif op == "halves":
        def halves(d):
            v = bgmv_shrink(d["x"], d["a"], d["slots"], d["scal"], d["ranks"], n_slices=len(d["b"]), **kw)
            return v, bgmv_expand(v, d["b"], d["base"], d["slots"], d["scal"], d["ranks"], **kw)
        v, ys = jax.jit(halves)(dev)
        row["shrink_violation"] = max_violation(v, v_ref, dtype)
    elif op == "sgmv":
        info = build_batch_info(np.asarray(dev["slots"]), np.asarray(dev["scal"]), np.asarray(dev["ranks"]))
        f = jax.jit(lambda d, o, st, ss: sgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], o, st, ss,
                                               d["scal"], d["ranks"], **kw))
        ys = f(dev, info.sorted_order, info.segment_starts, info.segment_slots)
    elif op == "backend":
        from lora_runtime.lora.backend.kernel import KernelLoRABackend

        backend = KernelLoRABackend(None, platform=run.platform, interpret=run.interpret)
        info = backend.prepare_lora_batch(np.asarray(dev["slots"]), np.asarray(dev["scal"]), np.asarray(dev["ranks"]))
        ys = jax.jit(lambda d, info: backend.run_qkv_lora(d["x"], d["a"], d["b"], d["base"], info, prefill=False))(
            dev, info)
    else:
        raise ValueError(f"{op=}")
    row["violation"] = max(max_violation(y, w, dtype) for y, w in zip(ys, y_ref))
    # A wrong-but-plausible kernel would still change the output; insist it did where it should.
    has = np.asarray(host["slots"]) >= 0
    if has.any():
        delta = max(float(np.abs(np.asarray(y, np.float64) - hb)[has].max()) for y, hb in zip(ys, host["base"]))
        row["delta_max"] = delta
    row["ok"] = bool(row["violation"] <= 1.0 and row.get("shrink_violation", 0.0) <= 1.0)
    return row


def section_layouts(run: Run) -> dict:
    """The layouts the device stores an adapter pool's arrays in (rank 4, 8 and 16; 63 and 64
    slots; bfloat16, with embedding and lm_head groups and DoRA and lora_bias terms), with the pool's rows and term slots exact
    (row_align 1) and as the engine lays them out on this platform: an array stored with
    another axis second-minor than its shape's is copied whole by every program that reads it
    (lora_runtime/lora/memory_pool.py, TPU_ROW_ALIGN)."""
    from benchmarks.common import LARGE_SHAPE, TINY_SHAPE, synthetic_config
    from lora_runtime.lora.memory_pool import LoRAMemoryPool
    from lora_runtime.model.sharding import make_mesh

    shape = dict(TINY_SHAPE if run.smoke else LARGE_SHAPE, layers=2)
    model_config = synthetic_config(dtype="bfloat16", vocab=259 if run.smoke else 128256, **shape)
    mesh = make_mesh(1, jax.devices()[:1])
    rows = []
    for rank, slots, align in ((4, 63, 1), (4, 63, None), (8, 64, 1), (16, 63, 1), (16, 63, None)):
        pool = LoRAMemoryPool.create(model_config, mesh, num_slots=slots, max_lora_rank=rank, dtype="bfloat16",
                                     outer=True, dora=True, bias=True, row_align=align)
        paths = jax.tree_util.tree_flatten_with_path((pool.a, pool.b, pool.scale, pool.shift))[0]
        off = [(jax.tree_util.keystr(k), tuple(x.shape), tuple(x.format.layout.major_to_minor)) for k, x in paths
               if tuple(x.format.layout.major_to_minor) != tuple(range(x.ndim))]
        row = {"rank": rank, "slots": slots, "rows": pool.classes[0].rows, "arrays": len(paths), "off": off}
        rows.append(row)
        print(f"  rank {rank:2d} slots {slots} rows {row['rows']:2d}: {len(off)} of {len(paths)} arrays off the "
              f"major-to-minor layout {off[:3]}", flush=True)
        del pool
    return {"rows": rows}


def section_correctness(run: Run) -> dict:
    rows = []
    for case in correctness_cases(run.smoke, run.platform):
        if run.out_of_time("correctness"):
            break
        t = time.perf_counter()
        try:
            row = run_correctness_case(run, *case)
        except Exception as e:
            traceback.print_exc()
            row = {"case": case[0], "ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}
        row["seconds"] = time.perf_counter() - t
        rows.append(row)
        status = "ok" if row["ok"] else "FAIL"
        print(f"  {row['case']:28s} {status:4s} violation={row.get('violation', float('nan')):.3g} "
              f"{row.get('error', '')[:200]}", flush=True)
    return {"rows": rows, "passed": sum(r["ok"] for r in rows), "total": len(rows)}


def attention_case(seed, *, groups, c, heads, kv_heads, d, bs, pages, dtype, shared_prefix=0, fill=None):
    """Paged attention inputs: pages in random order (page 0 the null page), groups that may
    share their first pages, each group's queries ending at a random position in its pages
    (at `fill` of them when given)."""
    rng = np.random.default_rng(seed)
    num_pages = 1 + groups * pages
    k = rng.standard_normal((kv_heads, num_pages, bs, d), np.float32)
    v = rng.standard_normal((kv_heads, num_pages, bs, d), np.float32)
    tables = rng.permutation(np.arange(1, num_pages))[: groups * pages].reshape(groups, pages)
    tables[:, :shared_prefix] = tables[0, :shared_prefix]
    if fill is None:
        q_start = rng.integers(0, pages * bs - c + 1, size=groups)
    else:
        q_start = np.full(groups, int(fill * pages * bs) - c)
    q = rng.standard_normal((groups, c, heads, d), np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables, np.int32), jnp.asarray(q_start, np.int32))


def attention_cases(smoke: bool):
    """(name, shape kwargs, window) for paged attention."""
    bf, f32 = jnp.bfloat16, jnp.float32
    if smoke:
        small = dict(groups=3, heads=4, kv_heads=2, d=128, bs=16, pages=3)
        return [("decode", dict(small, c=1, dtype=f32), None),
                ("chunk_shared_window", dict(small, c=8, dtype=bf, shared_prefix=1), 20)]
    llama = dict(heads=32, kv_heads=8, d=128, bs=128)
    return [
        ("decode_llama_bf16", dict(llama, groups=16, c=1, pages=8, dtype=bf), None),
        ("decode_llama_f32", dict(llama, groups=5, c=1, pages=4, dtype=f32), None),
        ("decode_window", dict(llama, groups=6, c=1, pages=6, dtype=bf), 300),
        ("extend_shared_prefix", dict(llama, groups=4, c=16, pages=6, dtype=bf, shared_prefix=3), None),
        ("prefill_chunk_128", dict(llama, groups=2, c=128, pages=4, dtype=bf), None),
        ("qwen_gqa7_window", dict(heads=28, kv_heads=4, d=128, bs=128, groups=3, c=4, pages=5, dtype=bf), 200),
        ("small_head_dim_64", dict(heads=8, kv_heads=8, d=64, bs=128, groups=4, c=1, pages=3, dtype=bf), None),
        # Llama-2-7B's multi-head attention: one query head a kv head, 16 heads a decode step.
        ("decode_mha_bf16", dict(heads=32, kv_heads=32, d=128, bs=128, groups=4, c=1, pages=4, dtype=bf), None),
        ("decode_mha_f32_window", dict(heads=32, kv_heads=32, d=128, bs=128, groups=3, c=1, pages=3, dtype=f32), 200),
        # A 2048-token chunk: the kernel cuts it into blocks of queries that fit its VMEM.
        ("prefill_chunk_2048", dict(llama, groups=1, c=2048, pages=17, dtype=bf), None),
    ]


def attention_timings(smoke: bool):
    """(name, shape kwargs) of Llama-3-8B decode batches, timed against the XLA formulation."""
    llama = dict(heads=32, kv_heads=8, d=128, bs=128, c=1, dtype=jnp.bfloat16, fill=1.0)
    if smoke:
        return [("decode_small", dict(llama, heads=4, kv_heads=2, bs=16, groups=2, pages=2))]
    return [(f"decode_B{b}_ctx{p * 128}", dict(llama, groups=b, pages=p)) for b, p in ((8, 8), (32, 8), (32, 32),
                                                                                        (64, 16))] + [
        ("decode_mha_B16_ctx1024", dict(llama, kv_heads=32, groups=16, pages=8))]


# Calls chained in one program to time one: the wall time of a single call also counts its
# dispatch and the wait for the host, about 0.6 ms on the TPU host (as much as a decode call).
CHAINED_CALLS = 9


def per_call_s(attend, case, repeats: int) -> float:
    """Seconds one attention call takes on the device: the time of CHAINED_CALLS calls in one
    program, each call's queries the last one's output (so none is hoisted or merged), less
    the time of one, over CHAINED_CALLS - 1."""
    q, *rest = case

    def chained(n):
        return jax.jit(lambda q, *a: jax.lax.fori_loop(0, n, lambda _, x: attend(x, *a), q))

    return (bench(chained(CHAINED_CALLS), q, *rest, repeats=repeats)
            - bench(chained(1), q, *rest, repeats=repeats)) / (CHAINED_CALLS - 1)


def section_attention(run: Run) -> dict:
    """The platform's paged-attention kernel against the dense reference (run on the host CPU
    in float32), then its decode time at Llama-3-8B shapes against the XLA formulation and the
    bytes it must read."""
    from kernels.paged_attention import paged_attention, ref_paged_attention

    cpu = jax.devices("cpu")[0]
    rows = []
    for name, shape, window in attention_cases(run.smoke):
        if run.out_of_time("attention"):
            break
        row: dict = {"case": name, "window": window, **{k: v for k, v in shape.items() if k != "dtype"},
                     "dtype": jnp.dtype(shape["dtype"]).name}
        try:
            case = attention_case(len(rows), **shape)
            f = jax.jit(lambda *a, w=window: paged_attention(*a, window=w, platform=run.platform,
                                                               interpret=run.interpret))
            got = f(*case)
            host = [jax.device_put(np.asarray(z.astype(jnp.float32) if z.dtype != jnp.int32 else z), cpu)
                    for z in case]
            want = jax.jit(lambda *a, w=window: ref_paged_attention(*a, window=w), backend="cpu")(*host)
            row["violation"] = max_violation(got, want, shape["dtype"])
            row["ok"] = row["violation"] <= 1.0
        except Exception as e:
            traceback.print_exc()
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
        rows.append(row)
        print(f"  {name:28s} {'ok' if row['ok'] else 'FAIL':4s} violation={row.get('violation', float('nan')):.3g} "
              f"{row.get('error', '')[:200]}", flush=True)
    timings = []
    copy_bps = run.record["sections"].get("benchmark", {}).get("copy_GBps")
    for name, shape in attention_timings(run.smoke):
        if run.out_of_time("attention timing"):
            break
        case = attention_case(7, **shape)
        row = {"case": name}
        kv_bytes = 2 * shape["groups"] * shape["pages"] * shape["bs"] * shape["kv_heads"] * shape["d"] * 2
        row["kv_MB"] = kv_bytes / 1e6
        for impl in (run.platform, "xla"):
            try:
                attend = functools.partial(paged_attention, platform=impl, interpret=run.interpret and impl != "xla")
                t = per_call_s(attend, case, repeats=1 if run.smoke else 10)
                row[f"{impl}_us"] = t * 1e6
                row[f"{impl}_GBps"] = kv_bytes / t / 1e9
            except Exception as e:
                row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:500]
        timings.append(row)
        print("  " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
    return {"rows": rows, "passed": sum(r["ok"] for r in rows), "total": len(rows), "timings": timings,
            "copy_GBps": copy_bps}


def section_cuda_lowering(run: Run) -> dict:
    """Smoke only: lower the GPU run's real-shape kernels for CUDA here, so a typo or an
    unsupported Triton construct shows up before the one device run."""
    rows = []
    sds = jax.ShapeDtypeStruct

    def lower(name, fn, *args):
        try:
            with gpu_lowering_target():
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            rows.append({"case": name, "ok": True})
        except Exception as e:
            rows.append({"case": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:800]})
        print(f"  {name:40s} {'ok' if rows[-1]['ok'] else 'FAIL ' + rows[-1]['error'][:300]}", flush=True)

    kw = dict(platform="gpu", interpret=False)
    for name, t, s, r, outs, in_f, dtype, op, _ in correctness_cases(smoke=False):
        n = len(outs)
        x, a = sds((t, in_f), dtype), sds((s, n * r, in_f), dtype)
        b = tuple(sds((s, r, o), dtype) for o in outs)
        base = tuple(sds((t, o), dtype) for o in outs)
        meta = (sds((t,), jnp.int32), sds((s,), jnp.float32), sds((s,), jnp.int32))
        if op == "sgmv":
            seg = (sds((t,), jnp.int32), sds((s + 1,), jnp.int32), sds((s,), jnp.int32))
            lower(name, lambda x, a, b, base, sl, o, st, ss, sc, rk: sgmv(x, a, b, base, sl, o, st, ss, sc, rk, **kw),
                  x, a, b, base, meta[0], *seg, meta[1], meta[2])
        elif op == "halves":
            lower(name, lambda x, a, b, base, sl, sc, rk, n=n: bgmv_expand(
                bgmv_shrink(x, a, sl, sc, rk, n_slices=n, **kw), b, base, sl, sc, rk, **kw), x, a, b, base, *meta)
        else:
            lower(name, lambda x, a, b, base, sl, sc, rk: bgmv(x, a, b, base, sl, sc, rk, **kw), x, a, b, base, *meta)
    shape = lk.Shape(**lk.HEADLINE)
    for bs in sweep_configs(smoke=False):
        prepare, layer = lk.lora_fn("kernel", "gpu", False, shape, bs)
        f = lk.stack_fn(prepare, layer)
        h, s_, r = shape.hidden, shape.num_slots, shape.rank
        lower(f"sweep {bs}", f, sds((shape.num_tokens, h), jnp.bfloat16), sds((4, s_, r, h), jnp.bfloat16),
              sds((4, s_, r, h), jnp.bfloat16), sds((shape.num_tokens,), jnp.int32), sds((s_,), jnp.float32),
              sds((s_,), jnp.int32))
    return {"rows": rows, "passed": sum(r["ok"] for r in rows), "total": len(rows)}


# ---------------------------------------------------------------- 3. block-size sweep


def sweep_configs(smoke: bool, platform: str = "gpu") -> list[BlockSizes]:
    if platform == "tpu":
        # Token blocks of one or two bf16 sublane tiles; the expand's output block of 1024 lanes
        # or the whole 4096 (the shrink reads an adapter's A whole, one DMA: bk is not swept).
        # Then the kernels walking the batch's distinct slots (kernels.bgmv.tpu), 2 and 4 blocks in flight.
        if smoke:
            return [BlockSizes(16, 1 << 16, 128), BlockSizes(32, 1 << 16, 256),
                    BlockSizes(16, 1 << 16, 128, slot_loop=2)]
        return ([BlockSizes(tm, 1 << 16, bn) for tm in (16, 32) for bn in (1024, 4096)]
                + [BlockSizes(16, 1 << 16, 4096, slot_loop=d) for d in (2, 4)])
    if smoke:
        return [BlockSizes(16, 64, 64, 2), BlockSizes(16, 128, 128, 1, num_warps=2),
                BlockSizes(16, 64, 64, single_launch=True)]
    configs = [
        BlockSizes(16, 256, 256, 8),
        BlockSizes(16, 256, 512, 8),
        BlockSizes(16, 256, 256, 4),
        BlockSizes(16, 512, 512, 4),
        BlockSizes(16, 128, 256, 16),
        BlockSizes(16, 256, 1024, 8),
        BlockSizes(16, 512, 256, 8, num_warps=8),
        BlockSizes(16, 256, 512, 8, num_warps=4, num_stages=3),
        BlockSizes(32, 256, 512, 8),
        BlockSizes(16, 1024, 512, 2),
        BlockSizes(16, 256, 1024, 8, num_warps=8),
        # One launch per projection (shrink and expand in one kernel), against the two above.
        BlockSizes(16, 256, 256, single_launch=True),
        BlockSizes(16, 512, 512, single_launch=True),
        BlockSizes(16, 256, 1024, single_launch=True),
        BlockSizes(16, 256, 128, single_launch=True),
        BlockSizes(16, 512, 256, num_warps=8, single_launch=True),
    ]
    return configs


def sweep_shape(smoke: bool) -> lk.Shape:
    return lk.Shape(16, 8, 256, 16) if smoke else lk.Shape(**lk.HEADLINE)


def section_sweep(run: Run) -> dict:
    shape = sweep_shape(run.smoke)
    layers, repeats = (2, 1) if run.smoke else (16, 20)
    args = lk.make_stack(shape, layers, jnp.bfloat16, seed=7)
    rows = []
    default = block_sizes(run.platform, shape.num_tokens, shape.hidden, jnp.bfloat16)
    for bs in [default] + [c for c in sweep_configs(run.smoke, run.platform) if c != default]:
        if run.out_of_time("sweep"):
            break
        row = {"block": dataclasses.asdict(bs), "default": bs == default}
        try:
            f = lk.stack_fn(*lk.lora_fn("kernel", run.platform, run.interpret, shape, bs))
            row["us_per_layer"] = bench(f, *args, repeats=repeats) / layers * 1e6
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        print(f"  {bs}: {row.get('us_per_layer', float('nan')):.1f} us/layer {row.get('error', '')[:160]}", flush=True)
    timed = [r for r in rows if "us_per_layer" in r]
    best = min(timed, key=lambda r: r["us_per_layer"]) if timed else None
    return {"shape": dataclasses.asdict(shape), "rows": rows, "best": best}


def best_block(run: Run) -> BlockSizes | None:
    """The sweep's winner for the headline shape, when the sweep ran."""
    best = run.record["sections"].get("sweep", {}).get("best")
    return BlockSizes(**best["block"]) if best else None


# ---------------------------------------------------------------- 4. benchmark


def section_benchmark(run: Run) -> dict:
    layers, repeats = (2, 1) if run.smoke else (16, 20)
    copy_bps = lk.copy_bandwidth((8 << 20) if run.smoke else (1 << 30), repeats=3 if run.smoke else 20)
    print(f"  copy bandwidth {copy_bps / 1e9:.0f} GB/s", flush=True)
    shapes = [lk.Shape(16, 8, 256, 16), lk.Shape(64, 64, 256, 16)] if run.smoke else lk.shapes(False, run.platform)
    tuned = best_block(run)
    rows = []
    for shape in shapes[-1:] + shapes[:-1]:  # the headline shape first
        if run.out_of_time("benchmark"):
            break
        try:
            # The kernel runs with the sweep's winner (the tuned table's entry otherwise).
            bs = tuned or block_sizes(run.platform, shape.num_tokens, shape.hidden, jnp.bfloat16)
            row = lk.run_shape(shape, platform=run.platform, interpret=run.interpret, layers=layers,
                               repeats=repeats, copy_bps=copy_bps, block=bs)
            row["block"] = dataclasses.asdict(bs)
        except Exception as e:
            traceback.print_exc()
            row = dict(dataclasses.asdict(shape), error=f"{type(e).__name__}: {e}"[:1000])
        rows.append(row)
        print("  " + (lk.format_row(row) if "distinct" in row else f"{shape}: {row['error'][:200]}"), flush=True)
        for key, val in row.items():
            if key.endswith("_error"):
                print(f"    {key}: {val[:300]}", flush=True)
    summary = lk.summary_line(rows[0]) if rows and "distinct" in rows[0] else "no headline row"
    print("  " + summary, flush=True)
    return {"copy_GBps": copy_bps / 1e9, "rows": rows, "summary": summary}


# ---------------------------------------------------------------- 5. 32-layer stack


def stack_impls(run: Run, num_slots: int, rank: int, block: BlockSizes | None, with_unhoisted: bool):
    """base and the LoRA formulations as 32-layer scans (device_anchor.py's stack)."""

    def scan_layers(x, w, a, b, layer):
        def body(h, wab):
            return layer(h, *wab).astype(jnp.bfloat16), None
        h, _ = lax.scan(body, x, (w, a, b))
        return h

    def base_step(x, w, a, b, idx):
        return scan_layers(x, w, a, b, lambda h, w_, a_, b_: h @ w_)

    def formulation(name):
        def step(x, w, a, b, idx):
            scal = jnp.ones((num_slots,), jnp.float32)
            return scan_layers(x, w, a, b, lambda h, w_, a_, b_: xla.lora(h, a_, (b_,), (h @ w_,), idx, scal, name)[0])
        return step

    def kernel(hoisted: bool):
        bs = block or block_sizes(run.platform, 64, 4096, jnp.bfloat16)

        def step(x, w, a, b, idx):
            # The pool stays stacked: the scan passes the layer index, the kernel reads
            # that layer in place (a scan slice feeding a custom call would be copied).
            scal = jnp.ones((num_slots,), jnp.float32)
            ranks = jnp.full((num_slots,), rank, jnp.int32)
            meta = bgmv_metadata(idx, num_slots, block=bs, platform=run.platform) if hoisted else None

            def body(h, wl):
                w_, layer = wl
                return bgmv(h, a, (b,), (h @ w_,), idx, scal, ranks, layer=layer, platform=run.platform,
                            interpret=run.interpret, block=bs, meta=meta)[0].astype(jnp.bfloat16), None
            return lax.scan(body, x, (w, jnp.arange(w.shape[0], dtype=jnp.int32)))[0]
        return step

    impls = {
        "base": jax.jit(base_step),
        "onehot": jax.jit(formulation("onehot")),
        "gather": jax.jit(formulation("gather")),
        "sorted": jax.jit(formulation("sorted")),
        "kernel": jax.jit(kernel(hoisted=True)),
    }
    if with_unhoisted:  # the slot sort inside every layer: does XLA hoist it out of the scan?
        impls["kernel_unhoisted"] = jax.jit(kernel(hoisted=False))
    return impls


def section_stack(run: Run) -> dict:
    layers, hidden, rank = (2, 256, 16) if run.smoke else (32, 4096, 16)
    grid = [(8, 16), (8, 64)] if run.smoke else [(s, t) for s in (8, 64, 256) for t in (16, 64, 256)]
    repeats = 1 if run.smoke else 20
    w = (jax.random.normal(jax.random.key(0), (layers, hidden, hidden), jnp.float32) * 0.02).astype(jnp.bfloat16)
    block = best_block(run)
    rows = []
    for num_slots in sorted({s for s, _ in grid}):
        pool_shape = (layers, num_slots, rank, hidden)
        a = (jax.random.normal(jax.random.key(2), pool_shape, jnp.float32) * 0.05).astype(jnp.bfloat16)
        b = (jax.random.normal(jax.random.key(3), pool_shape, jnp.float32) * 0.05).astype(jnp.bfloat16)
        impls = stack_impls(run, num_slots, rank, block, with_unhoisted=num_slots in (8, 64))
        for s, t in grid:
            if s != num_slots or run.out_of_time("stack"):
                continue
            idx = jax.random.randint(jax.random.key(t + s), (t,), 0, s)
            distinct = int(np.unique(np.asarray(idx)).size)
            x = jax.random.normal(jax.random.key(4), (t, hidden), jnp.float32).astype(jnp.bfloat16)
            base_bytes = layers * hidden * hidden * 2
            lora_bytes = layers * distinct * rank * 2 * hidden * 2
            row = {"S": s, "T": t, "distinct": distinct, "roofline_ratio": (base_bytes + lora_bytes) / base_bytes}
            ref = None
            for name, f in impls.items():
                try:
                    row[name + "_us"] = bench(f, x, w, a, b, idx, repeats=repeats) * 1e6
                    if name != "base":
                        y = np.asarray(f(x, w, a, b, idx), np.float32)
                        ref = y if ref is None else ref
                        row[name + "_relerr"] = float(np.linalg.norm(y - ref) / (np.linalg.norm(ref) + 1e-9))
                except Exception as e:
                    row[name + "_error"] = f"{type(e).__name__}: {e}"[:500]
            base_us = row.get("base_us", float("nan"))
            for name in impls:
                if name != "base" and name + "_us" in row:
                    row[name + "_x"] = row[name + "_us"] / base_us
            rows.append(row)
            print("  " + stack_line(row), flush=True)
            for key, val in row.items():
                if key.endswith("_error"):
                    print(f"    {key}: {val[:300]}", flush=True)
        del a, b
    return {"layers": layers, "hidden": hidden, "rank": rank, "rows": rows}


def stack_line(row: dict) -> str:
    cols = " ".join(f"{n}={row.get(n + '_x', float('nan')):5.2f}x"
                    for n in ("onehot", "gather", "sorted", "kernel", "kernel_unhoisted"))
    return (f"S={row['S']:4d} T={row['T']:4d} D={row['distinct']:4d} roof={row['roofline_ratio']:.2f} "
            f"base={row.get('base_us', float('nan')):8.1f}us {cols}")


# ---------------------------------------------------------------- targets and table


def targets(run: Run) -> dict:
    """The issue's GPU targets, judged from the recorded rows (None: not measured)."""
    bench_rows = [r for r in run.record["sections"].get("benchmark", {}).get("rows", []) if "kernel_us" in r]
    stack_rows = [r for r in run.record["sections"].get("stack", {}).get("rows", []) if "kernel_x" in r]
    out = {}
    big = [r for r in bench_rows if r["num_tokens"] >= 64]
    out["bandwidth_fraction>=0.6 at T>=64"] = (all(r["bandwidth_fraction"] >= 0.6 for r in big), [
        round(r["bandwidth_fraction"], 3) for r in big]) if big else (None, [])
    s64 = [r for r in bench_rows if r["num_slots"] == 64 and "onehot_us" in r]
    out[">=3x faster than one-hot at S=64"] = (all(r["onehot_us"] / r["kernel_us"] >= 3 for r in s64), [
        round(r["onehot_us"] / r["kernel_us"], 2) for r in s64]) if s64 else (None, [])
    g = [r["gather_us"] / r["kernel_us"] for r in bench_rows if "gather_us" in r]
    g += [r["gather_x"] / r["kernel_x"] for r in stack_rows if "gather_x" in r]
    out["faster than gather at every shape"] = (all(x > 1 for x in g), [round(x, 2) for x in g]) if g else (None, [])
    roof = [r["kernel_x"] / r["roofline_ratio"] for r in stack_rows]
    out["stack ratio within 1.15x of roofline"] = (all(x <= 1.15 for x in roof), [round(x, 3) for x in roof]) \
        if roof else (None, [])
    return {k: {"pass": v[0], "values": v[1]} for k, v in out.items()}


def print_table(run: Run) -> None:
    sec = run.record["sections"]
    print("\n==================== device_check summary ====================")
    env = sec.get("env", {})
    print(f"jax {env.get('jax', '?')} devices {env.get('devices', '?')} smoke={run.smoke} "
          f"elapsed={run.elapsed():.0f}s")
    low = sec.get("cuda_lowering", {})
    if "rows" in low:
        print(f"cuda lowering at real shapes: {low['passed']}/{low['total']} lowered")
    corr = sec.get("correctness", {})
    if "rows" in corr:
        bad = [r["case"] for r in corr["rows"] if not r["ok"]]
        print(f"correctness: {corr['passed']}/{corr['total']} passed" + (f"; failed: {', '.join(bad)}" if bad else ""))
    else:
        print(f"correctness: {corr}")
    att = sec.get("attention", {})
    if "rows" in att:
        bad = [r["case"] for r in att["rows"] if not r["ok"]]
        print(f"attention: {att['passed']}/{att['total']} passed" + (f"; failed: {', '.join(bad)}" if bad else ""))
        for row in att.get("timings", []):
            print("attention " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in row.items() if not k.endswith("_error")))
    best = sec.get("sweep", {}).get("best")
    if best:
        print(f"sweep best: {best['block']} {best['us_per_layer']:.1f} us/layer")
    for row in sec.get("stack", {}).get("rows", []):
        print("stack " + stack_line(row))
    for row in sec.get("benchmark", {}).get("rows", []):
        if "distinct" in row:
            print("bench " + lk.format_row(row))
    for name, t in run.record.get("targets", {}).items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        print(f"target {verdict:4s} {name}: {t['values']}")
    if run.smoke:
        print("(cpu smoke: interpret-mode timings, the targets are not meaningful here)")
    print(sec.get("benchmark", {}).get("summary", "benchmark: not run"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas interpret mode, any machine")
    p.add_argument("--out", default=None, help="output folder (default $OUT or ./.device_out)")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip sections that would start past this")
    p.add_argument("--sections", default=None,
                   help="comma-separated subset of env,layouts,correctness,attention,sweep,stack,benchmark")
    p.add_argument("--platform", choices=("gpu", "tpu"), default=None,
                   help="whose kernels (default: the machine's; gpu on a CPU-only machine)")
    args = p.parse_args(argv)
    run = Run(args)
    if not run.smoke and default_platform() != run.platform:
        print(f"warning: backend is {jax.default_backend()!r}, not {run.platform}; use --cpu-smoke there", flush=True)
    wanted = set(args.sections.split(",")) if args.sections else None
    sections = [("env", section_env, 0), ("layouts", section_layouts, 0), ("correctness", section_correctness, 60),
                ("attention", section_attention, 30), ("sweep", section_sweep, 150), ("stack", section_stack, 60),
                ("benchmark", section_benchmark, 30)]
    if run.smoke and run.platform == "gpu":
        sections.insert(1, ("cuda_lowering", section_cuda_lowering, 0))
    for name, fn, min_left_s in sections:
        if wanted is None or name in wanted:
            run.section(name, fn, min_left_s)
    run.record["targets"] = targets(run)
    run.record["elapsed_s"] = run.elapsed()
    run.save()
    print_table(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
