"""The serving benchmark's workload sent to the engine in process, without HTTP: how close serving
many adapters comes to serving the base model alone where the model's steps have the machine to
themselves (an accelerator host's case).

    python -m benchmarks.engine_serving [--large] [--adapters 64] [--alpha 1.0] [--slots 8]
        [--adapter-memory-fraction F]
        [--rates R ...] [--requests N] [--duration S] [--input-len LO HI] [--output-len LO HI]
        [--trace-rate R [--trace-window AFTER SECONDS] [--trace-dir DIR]]

The workload is benchmarks/serving_workload.py's (the one `benchmarks.serving` sends over HTTP):
`--adapters` adapters of Zipf(`--alpha`) popularity, Poisson arrivals at each rate, prompt and
output lengths uniform in their ranges, the same requests for both engines:

- `base`: an engine with LoRA off, every request on the base model (the ceiling);
- `adapters`: the LoRA engine with `--slots` device slots and every adapter in its host cache,
  each request on its drawn adapter (random rank-16 adapters on all seven modules, registered
  from local disk).

A driver thread submits each request at its arrival time; the engine's emit callback stamps its
first and last token. Per run: requests/s and output tokens/s (from the first submission to the last
token), TTFT and TPOT p50/p99, SLO attainment, the mean rows of a decode step (how full the batches
ran), the mean wall time of a decode step and of a step that ran prompts, and the count of those
(TPOT holds both: a prompt step stalls the rows decoding beside it; with async decode a packed
prompt step runs between two decode steps without a pause for the host, and its time, from its
dispatch to its first tokens on the host, overlaps theirs) and, for the LoRA engine, adapter loads
into device slots and the mean queue time of the requests whose adapter was loaded for them
(`slot wait ms`). The engines run one after the other (each plans its KV cache from the device's free
memory), each warmed up first on a burst of the first rate's requests and, for the LoRA engine, a
request on every adapter, so each adapter has been read from storage into the host cache once (a
server that has been up a while): the runs measure the device slots' turnover, not first reads.

`--trace-rate R`: the run at rate R of each engine is traced by JAX's profiler (without its Python
tracer), and a table per engine splits the device's time over the run by program: runs, device time,
and the idle time just before its runs (benchmarks/serving_trace.py), per decode step (the runs of
the decode program in the trace). `--trace-window AFTER SECONDS` bounds the trace to SECONDS from
AFTER seconds into the run.

Default shape: a small random Llama for CPU. `--large`: 8 layers of Llama-3-8B widths in bfloat16
on the demo tokenizer's vocabulary, async decode, for an accelerator.

Last line, at the highest rate whose LoRA p99 TTFT is under `--slo-ttft-s` (else the lowest):
`lora_over_base_throughput=<f> ttft_p99_ms=<f> tpot_p99_ms=<f> slot_loads_per_request=<f>
compiles_after_warmup=<n>` (requests/s of the LoRA engine over the LoRA-off engine's, on the same
requests; compiles after warm-up over both engines, from JAX's compile events).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import tempfile
import threading
import time
from collections.abc import Sequence

from benchmarks.common import (
    LARGE_SHAPE,
    demo_tokenizer,
    print_table,
    synthetic_config,
    synthetic_engine,
    write_random_adapter,
)
from benchmarks.serving_trace import (
    TraceSummary,
    decode_runs,
    op_lines,
    read_trace,
    table_rows,
    traced,
    write_summary,
)
from benchmarks.serving_workload import (
    RequestRecord,
    RunSummary,
    WorkItem,
    WorkloadSpec,
    headline_rate,
    make_workload,
    summarize,
)
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling_params import SamplingParams

SMALL_SHAPE = dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512)
RANK = 16


@dataclasses.dataclass(frozen=True)
class EngineRun:
    system: str  # "base" or "adapters"
    spec: WorkloadSpec
    summary: RunSummary
    slot_loads: int  # adapter loads into device slots during the run
    rows_per_step: float = float("nan")  # mean running rows of the run's decode steps (max_batch at most)
    slot_wait_ms: float = float("nan")  # mean queue time of the requests whose adapter was loaded for them
    decode_ms: float = float("nan")  # mean wall time of a decode step (host work included)
    prefill_steps: int = 0  # steps that ran prompts (a prefill's time is the device's and the host's both)
    prefill_ms: float = float("nan")  # mean wall time of those steps
    decode_steps: int = 0
    trace: TraceSummary | None = None  # the device's time by program, with --trace-rate


def send(engine, items: Sequence[WorkItem], adapters: Sequence[str | None], timeout_s: float) -> list[RequestRecord]:
    """Submits each request at its arrival time (`adapters[i]` for items[i]) and waits for all;
    returns what each saw (perf_counter times of submission, first and last token)."""
    records = [RequestRecord(sent=0.0) for _ in items]
    done = threading.Semaphore(0)

    def emitter(record: RequestRecord):
        def emit(out) -> None:  # on the engine's loop thread
            now = time.perf_counter()
            if out.error is not None:
                record.error = f"{type(out.error).__name__}: {out.error}"
            elif out.token_ids and record.first_token is None:
                record.first_token = now
            record.completion_tokens = out.completion_tokens
            if out.finished or out.error is not None:
                record.last_token = now
                done.release()

        return emit

    start = time.perf_counter()
    for item, adapter, record in zip(items, adapters, records):
        delay = start + item.send_at_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        record.sent = time.perf_counter()
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
        engine.submit(item.prompt, params, emitter(record), adapter=adapter)
    deadline = time.monotonic() + timeout_s
    for _ in items:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"the requests did not finish within {timeout_s:.0f} s")
    return records


def run_engine(system: str, engine, specs: Sequence[WorkloadSpec], names: list[str] | None, a) -> list[EngineRun]:
    """Every workload of `specs` sent to `engine`, after a warm-up burst; `names`: the adapters by
    popularity rank (None: every request on the base model)."""
    def adapters_of(items):
        return [None if names is None else names[item.adapter] for item in items]

    burst = dataclasses.replace(specs[0], rate=1e4, max_requests=2 * engine.config.max_batch, seed=specs[0].seed + 1)
    warm_items = make_workload(burst)
    send(engine, warm_items, adapters_of(warm_items), timeout_s=a.timeout)
    if names is not None:  # every adapter read from storage into the host cache once, as on a server up a while
        for i in range(0, len(names), engine.config.max_batch):
            group = names[i:i + engine.config.max_batch]
            items = [dataclasses.replace(warm_items[0], send_at_s=0.0, adapter=j) for j in range(i, i + len(group))]
            send(engine, items, group, timeout_s=a.timeout)
    runs = []
    for spec in specs:
        items = make_workload(spec)
        before = _counts(engine)
        trace_dir = os.path.join(a.trace_dir, system) if spec.rate == a.trace_rate else None
        window = None
        if trace_dir and a.trace_window:  # starts while requests are still being sent
            window = (min(a.trace_window[0], 0.5 * items[-1].send_at_s), a.trace_window[1])
        with traced(trace_dir, window) if trace_dir else contextlib.nullcontext():
            records = send(engine, items, adapters_of(items), timeout_s=a.timeout)
        n = {k: v - before[k] for k, v in _counts(engine).items()}
        summary = summarize(records, slo_ttft_s=a.slo_ttft_s, slo_tpot_s=a.slo_tpot_s)
        def mean(total: str, count: str, scale: float = 1.0) -> float:
            return scale * n[total] / n[count] if n[count] else float("nan")

        runs.append(EngineRun(system, spec, summary, int(n["loads"]), mean("decode_row_steps", "decode_steps"),
                              mean("adapter_slot_wait_seconds", "adapter_slot_waits", 1e3),
                              mean("decode_seconds", "decode_steps", 1e3), int(n["prefill_steps"]),
                              mean("prefill_seconds", "prefill_steps", 1e3), int(n["decode_steps"]),
                              _trace_summary(trace_dir) if trace_dir else None))
    return runs


def _trace_summary(trace_dir: str) -> TraceSummary:
    summary = read_trace(trace_dir)
    write_summary(summary, os.path.join(trace_dir, "summary.json"))
    return summary


def _counts(engine) -> dict[str, float]:
    """The engine's counters a run's figures are differences of (read while it is idle)."""
    stats = engine.stats()
    loads = engine.lora_manager.stats().loads if engine.lora_manager is not None else 0
    keys = ("decode_steps", "decode_row_steps", "decode_seconds", "prefill_steps", "prefill_seconds",
            "adapter_slot_waits", "adapter_slot_wait_seconds")
    return {"loads": loads, **{k: stats.get(k, 0) for k in keys}}


def measure(system: str, engine, specs: Sequence[WorkloadSpec], names: list[str] | None,
            a) -> tuple[list[EngineRun], int]:
    """run_engine on a started `engine`, shut down after; returns its runs and its compiles after
    warm-up."""
    engine.start()
    try:
        return run_engine(system, engine, specs, names, a), engine.compiles_after_warmup
    finally:
        engine.shutdown()


def headline(runs: Sequence[EngineRun], slo_ttft_s: float, compiles: int) -> tuple[str, str]:
    """The last line and a note on the rate it is at."""
    lora = {r.spec.rate: r for r in runs if r.system == "adapters"}
    base = {r.spec.rate: r for r in runs if r.system == "base"}
    rate, within = headline_rate({rate: r.summary.ttft_p99_ms for rate, r in lora.items()}, slo_ttft_s)
    note = f"last line at {rate} req/s" + ("" if within else f" (no rate kept the LoRA p99 TTFT under {slo_ttft_s} s)")
    ours, ceiling = lora[rate], base[rate]
    ratio = (ours.summary.requests_per_s / ceiling.summary.requests_per_s
             if ceiling.summary.requests_per_s > 0 else float("nan"))
    per_request = ours.slot_loads / ours.summary.requests if ours.summary.requests else float("nan")
    return (f"lora_over_base_throughput={ratio:.4f} ttft_p99_ms={ours.summary.ttft_p99_ms:.2f} "
            f"tpot_p99_ms={ours.summary.tpot_p99_ms:.2f} slot_loads_per_request={per_request:.4f} "
            f"compiles_after_warmup={compiles}"), note


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", action="store_true", help="8 layers of Llama-3-8B widths, bfloat16, async decode")
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--slots", type=int, default=8, help="device adapter slots (max_loras_per_batch)")
    parser.add_argument("--adapter-memory-fraction", type=float, default=None,
                        help="size the slots from the device's memory (adapter_memory_fraction; at least --slots)")
    parser.add_argument("--max-batch", type=int, default=None, help="rows a step (default 32 with --large, else 16)")
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="prompt tokens a step (default: a whole batch of the longest prompts, so admission "
                        "is not held to a few prompts a step by the short max_seq_len)")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="requests/s, Poisson (default 100 400 1600 with --large, else 16 64 256: the last past "
                        "the engines' capacity)")
    parser.add_argument("--requests", type=int, default=None, help="most requests a run (default 400, 96 on CPU)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds a run sends for, at most")
    parser.add_argument("--input-len", type=int, nargs=2, default=(8, 24), metavar=("LO", "HI"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 24), metavar=("LO", "HI"))
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-tpot-s", type=float, default=0.2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take to finish")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-rate", type=float, default=None,
                        help="trace each engine's run at this rate (one of --rates) and split its device time "
                        "by program")
    parser.add_argument("--trace-window", type=float, nargs=2, default=None, metavar=("AFTER", "SECONDS"),
                        help="trace SECONDS of the run from AFTER seconds into it (at most half its sending time), "
                        "not the whole run")
    parser.add_argument("--trace-dir", default=None, help="where the traces go, each engine's under its system's name "
                        "with its summary.json (program times, busiest ops' HLO text); default: a temporary directory")
    a = parser.parse_args(argv)
    a.max_batch = a.max_batch or (32 if a.large else 16)
    a.max_prefill_tokens = a.max_prefill_tokens or max(16, a.max_batch * a.input_len[1])
    a.rates = a.rates or ([100.0, 400.0, 1600.0] if a.large else [16.0, 64.0, 256.0])
    a.requests = a.requests or (400 if a.large else 96)
    a.input_len, a.output_len = tuple(a.input_len), tuple(a.output_len)
    if a.adapter_memory_fraction is not None and not 0 < a.adapter_memory_fraction < 1:
        parser.error(f"--adapter-memory-fraction={a.adapter_memory_fraction} must be in (0, 1)")
    for name in ("adapters", "slots", "max_batch", "requests"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be at least 1")
    if any(rate <= 0 for rate in a.rates):
        parser.error(f"--rates={a.rates} must be positive")
    if a.trace_rate is not None and a.trace_rate not in a.rates:
        parser.error(f"--trace-rate={a.trace_rate} is not one of --rates {a.rates}")
    if a.trace_window is not None and (a.trace_window[0] < 0 or a.trace_window[1] <= 0):
        parser.error(f"--trace-window={a.trace_window}: need AFTER >= 0 and SECONDS > 0")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(a, name)
        if not 2 <= lo <= hi:
            parser.error(f"--{name.replace('_', '-')}={lo} {hi}: need 2 <= LO <= HI")
    return a


def main(argv: list[str] | None = None) -> str:
    a = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        a.trace_dir = a.trace_dir or tmp
        return _main(a)


def _main(a: argparse.Namespace) -> str:
    shape, dtype = (LARGE_SHAPE, "bfloat16") if a.large else (SMALL_SHAPE, "float32")
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, dtype=dtype, **shape)
    config = EngineConfig(max_batch=a.max_batch, max_seq_len=a.input_len[1] + a.output_len[1] + 8,
                          max_prefill_tokens=a.max_prefill_tokens, max_loras_per_batch=a.slots,
                          max_lora_rank=RANK, max_cpu_loras=a.adapters,
                          adapter_memory_fraction=a.adapter_memory_fraction,
                          async_decode=a.large)
    specs = [WorkloadSpec(a.adapters, a.alpha, rate, a.requests, a.duration, a.input_len, a.output_len, a.seed)
             for rate in a.rates]
    base_config = config.model_copy(update={"max_loras_per_batch": 0, "adapter_memory_fraction": None})
    engine = synthetic_engine(model_config, base_config, tokenizer)
    runs, compiles = measure("base", engine, specs, None, a)
    del engine  # its KV cache took the plan's share of device memory: free it before the next engine
    gc.collect()
    engine = synthetic_engine(model_config, config, tokenizer)
    slots = engine.lora_manager.num_slots  # --slots, or what --adapter-memory-fraction sized
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"zipf-{i:04d}" for i in range(a.adapters)]
        for i, name in enumerate(names):
            path = write_random_adapter(f"{tmp}/{name}", model_config, r=RANK, alpha=2 * RANK, seed=i)
            engine.lora_manager.register(name, str(path))
        lora_runs, lora_compiles = measure("adapters", engine, specs, names, a)
    runs, compiles = runs + lora_runs, compiles + lora_compiles
    line, note = headline(runs, a.slo_ttft_s, compiles)
    print(f"engine in process: {shape} {dtype}, max_batch {a.max_batch}, {a.adapters} rank-{RANK} adapters of "
          f"Zipf alpha {a.alpha} through {slots} device slots, input {a.input_len[0]}-{a.input_len[1]} and output "
          f"{a.output_len[0]}-{a.output_len[1]} tokens, {a.requests} requests or {a.duration:.0f} s a run")
    rows = []
    for r in sorted(runs, key=lambda r: (r.spec.rate, r.system)):
        s = r.summary
        rows.append([r.system, r.spec.rate, s.requests, s.errors, s.requests_per_s, s.output_tokens_per_s,
                     s.ttft_p50_ms, s.ttft_p99_ms, s.tpot_p50_ms, s.tpot_p99_ms, f"{100 * s.slo_attainment:.0f}%",
                     f"{r.rows_per_step:.1f}", f"{r.decode_ms:.2f}", r.prefill_steps, f"{r.prefill_ms:.2f}",
                     *([r.slot_loads, f"{r.slot_wait_ms:.0f}"] if r.system == "adapters"
                                                 else ["-", "-"])])
    print_table(["system", "rate", "requests", "errors", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "TPOT p99 ms", "SLO", "rows/step", "decode ms", "prefills", "prefill ms",
                 "slot loads", "slot wait ms"], rows)
    for r in runs:
        if r.trace is not None:
            t = r.trace
            steps = decode_runs(t)
            print(f"\nthe trace of the {r.system} run at {r.spec.rate} req/s: {t.window_ns / 1e9:.2f} s, "
                  f"the device busy {100 * t.busy_ns / t.window_ns:.0f}% of it, {steps} decode steps (the run: "
                  f"{r.decode_steps}, {r.decode_ms:.2f} ms a step by the wall clock)")
            print_table(["program", "runs", "a step", "ms a run", "ms a step", "idle before ms a step"],
                        table_rows(t, steps))
            print("\n".join(op_lines(t)))
    print(note)
    print(line)
    return line


if __name__ == "__main__":
    main()
