"""Where a decode step's time goes: the device's own op times against the step's wall time.

    python -m benchmarks.step_profile [--large] [--batch B] [--adapters N] [--slots S] [--new-tokens T] [--top K]
        [--out DIR]

Builds the engine `benchmarks.multi_lora` measures (a batch of 8, or `--batch`, on the demo tokenizer's
vocabulary; `--large`: 8 layers of Llama-3-8B widths in bfloat16), decodes one batch to warm
it, then decodes another under `jax.profiler.trace` and reads the trace back with
`jax.profiler.ProfileData`. XLA's op events (the device's "XLA Ops" line on an accelerator,
the executing threads' `hlo_op` events on CPU; an event enclosing others, a loop's, is left
out for its body's) are grouped by the program they ran in, named by the engine's programs
(`jit_decode` is the forward of a decode step, `jit_sample` its sampler). For the forward the
table gives each op kind's time per step (the op's name without its number), its runs per
step and its share, and the last line its busy time per step (the union of its ops'
intervals: a CPU runs ops on several threads at once) against the engine's own decode-step
wall time (`decode_seconds`: wall clock from one decode step's tokens on the host to the
next's, host work included). A second table splits the engine thread's
decode step by the calls the profiler's Python tracer saw: building the inputs, launching the
forward, the host work done while it runs, launching the sampler, waiting for the tokens (with
async_decode, the step before's, read while this one computes), their text and stream items,
and the rest (settling them).

Last line: `step_ms=<f> untraced_step_ms=<f> device_ms=<f> device_share=<f> top_op=<name> top_op_share=<f>`
(`untraced_step_ms`: the same batch's decode steps before the trace; the profiler's Python tracer
slows the host's side of a step several times over on some hosts).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import tempfile

import jax
from jax.profiler import ProfileData

from benchmarks.common import demo_tokenizer, print_table, synthetic_config, synthetic_engine, write_random_adapter
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling_params import SamplingParams

_NUMBER = re.compile(r"[._]\d+$")


def _stats(event) -> dict:
    return {k: v for k, v in event.stats}


def op_kind(text: str) -> str:
    """An op's kind: its name without the number. A TPU trace names an op by its whole HLO
    instruction (`%fusion.106 = bf16[8,4096]... fusion(...)`), CPU by the name alone."""
    name = text[1:text.index(" = ")] if text.startswith("%") and " = " in text else text
    return _NUMBER.sub("", name)


def _leaves(events: list) -> list:
    """The events of one line that enclose no other (a while loop's event holds its body's ops)."""
    events = sorted(events, key=lambda e: (e.start_ns, -e.end_ns))
    return [e for i, e in enumerate(events) if i + 1 == len(events) or events[i + 1].start_ns >= e.end_ns]


def op_events(profile: ProfileData) -> list[dict]:
    """Every leaf XLA op execution in the trace: {program, run, kind, text, ns, start, end}. The
    program is the device's "XLA Modules" event the op ran within (its name carries the program
    id) on an accelerator, the op's module and program id on CPU; `run` tells the program's
    executions apart (the module event's start on an accelerator, XLA's run id on CPU)."""
    out = []
    for plane in profile.planes:
        on_device = plane.name.startswith("/device:")
        lines = {line.name: list(line.events) for line in plane.lines}
        modules = sorted(lines.get("XLA Modules", []), key=lambda e: e.start_ns)
        for line_name, line_events in lines.items():
            if on_device and line_name != "XLA Ops":
                continue
            ops = [(e, _stats(e)) for e in line_events]
            ops = [(e, s) for e, s in ops if on_device or "hlo_op" in s]
            leaves = {id(e) for e in _leaves([e for e, _ in ops])}
            m = 0
            for event, stats in sorted(ops, key=lambda es: es[0].start_ns):
                if id(event) not in leaves:
                    continue
                if on_device:
                    while m + 1 < len(modules) and modules[m].end_ns <= event.start_ns:
                        m += 1
                    program = modules[m].name if modules else "?"
                    run = modules[m].start_ns if modules else 0
                else:
                    program = f"{stats.get('hlo_module', '?')}({stats.get('program_id', '?')})"
                    run = stats.get("run_id", 0)
                text = str(stats.get("hlo_op", event.name))
                out.append({"program": program, "run": run, "kind": op_kind(text), "text": text,
                            "ns": float(event.duration_ns), "start": event.start_ns, "end": event.end_ns})
    return out


def newest_trace(directory: str) -> str:
    """The newest profiler trace (`*.xplane.pb`) written under `directory`."""
    files = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no trace written under {directory}")
    return files[-1]


# The engine thread's decode step as the profiler's Python tracer names its calls
# (`$engine.py:847 _decode`): the parts a step's host time splits into, by function.
ENGINE_THREAD = "engine-loop"
STEP_CALL = "engine.py _decode"
HOST_PARTS = {
    "engine.py _paged_inputs": "build the step's inputs",
    "runner.py op_forward": "launch the forward",
    "engine.py while_forward": "host work while it runs (text, masks)",
    "runner.py op_sample": "launch the sampler",
    "runner.py get": "wait for the tokens (device, copy back)",
    "engine.py _catch_up_text": "their text, stream items",
}
OTHER_PART = "settle the tokens, the rest"


def _function(name: str) -> str:
    """A Python tracer event's file and function: `$runner.py:77 get` -> `runner.py get`."""
    where, _, function = name.lstrip("$").partition(" ")
    return f"{where.split(':')[0]} {function}"


def host_parts(profile: ProfileData) -> tuple[int, dict[str, float]]:
    """(decode steps, {part: ns per step}) of the engine thread's decode steps, from the Python
    tracer's events: each engine `_decode` call split by the outermost calls of HOST_PARTS inside it,
    the rest under OTHER_PART. (0, {}) when the trace has no such thread."""
    events = []
    for plane in profile.planes:
        for line in plane.lines:
            if line.name == ENGINE_THREAD:
                events += [(e.start_ns, e.end_ns, _function(e.name)) for e in line.events]
    return split_steps(events)


def split_steps(events: list[tuple[int, int, str]]) -> tuple[int, dict[str, float]]:
    """host_parts over (start, end, "file function") events of one thread."""
    events = sorted(events, key=lambda e: (e[0], -e[1]))
    steps = [e for e in events if e[2] == STEP_CALL]
    total: collections.Counter = collections.Counter()
    for start, end, _ in steps:
        reach, counted = start, 0
        for s, e, fn in events:
            if s < reach or e > end or fn not in HOST_PARTS:
                continue  # before this step, inside a part already counted, after it, or no part
            total[HOST_PARTS[fn]] += e - s
            counted += e - s
            reach = e
        total[OTHER_PART] += (end - start) - counted
    return len(steps), ({k: v / len(steps) for k, v in total.items()} if steps else {})


def step_programs(events: list[dict], part: str) -> list[dict]:
    """The events of the programs named for `part` ("decode": the forward, `jit_decode` from
    the engine's stored programs, `jit__decode_impl` traced; "sample": the sampler)."""
    return [e for e in events if part in e["program"].split("(")[0]]


def breakdown(events: list[dict], steps: int):
    """(busy ns per step, [(op kind, op ns per step)], the same per op) of the decode forward's
    programs over `steps` decode steps."""
    forward = step_programs(events, "decode")
    if not forward:
        raise SystemExit(f"no decode program among {sorted({e['program'] for e in events})}")
    return busy_ns(forward) / steps, per_step(forward, "kind", steps), per_step(forward, "text", steps)


def busy_ns(events: list[dict]) -> float:
    """The time some op of `events` ran: the union of their intervals (a CPU runs a program's
    ops on several threads at once, so their durations add up past the wall time)."""
    total, reach = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["start"]):
        if e["end"] > reach:
            total += e["end"] - max(e["start"], reach)
            reach = e["end"]
    return total


def per_step(events: list[dict], field: str, n: int) -> list[tuple[str, float]]:
    """[(events' `field`, ns per execution)], most first."""
    total: collections.Counter = collections.Counter()
    for e in events:
        total[e[field]] += e["ns"]
    return sorted(((k, ns / n) for k, ns in total.items()), key=lambda kv: -kv[1])


def calls_per_step(events: list[dict], n: int) -> dict[str, float]:
    """{op kind: executions per step} of `events` over `n` steps."""
    counts = collections.Counter(e["kind"] for e in events)
    return {k: c / n for k, c in counts.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large", action="store_true", help="8 layers of Llama-3-8B widths, bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 8, or 2 without --large)")
    parser.add_argument("--batch", type=int, default=8, help="rows decoded a step")
    parser.add_argument("--adapters", type=int, default=0, help="distinct rank-16 adapters in the batch (rows take "
                        "them in turn)")
    parser.add_argument("--slots", type=int, default=None, help="the pool's device slots (default --batch; at least "
                        "--adapters): a serving pool holds more adapters than one step uses")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=None, help="keep the trace and a JSON summary here")
    args = parser.parse_args(argv)
    if args.batch < 1 or not 0 <= args.adapters <= args.batch:
        parser.error(f"--batch={args.batch} --adapters={args.adapters}: need 1 <= batch and 0 <= adapters <= batch")
    if args.slots is not None and args.slots < max(1, args.adapters):
        parser.error(f"--slots={args.slots} must be at least --adapters ({args.adapters}) and 1")
    batch, rank = args.batch, 16
    if args.large:
        shape = dict(hidden=4096, layers=args.layers or 8, heads=32, kv_heads=8, intermediate=14336)
        dtype = "bfloat16"
    else:
        shape = dict(hidden=256, layers=args.layers or 2, heads=4, kv_heads=2, intermediate=512)
        dtype = "float32"
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, dtype=dtype, **shape)
    prompt = [3 + (i % 50) for i in range(32)]
    # The batch's prompts in one prefill step, so every decode step profiled is a steady one (a
    # prefill between decode steps would take the device time of the step in flight as its own).
    config = EngineConfig(max_batch=batch, max_seq_len=64 + args.new_tokens, max_lora_rank=rank,
                          max_loras_per_batch=(args.slots or batch) if args.adapters else 0,
                          max_prefill_tokens=batch * len(prompt))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine = synthetic_engine(model_config, config, tokenizer)
    out_dir = args.out or tempfile.mkdtemp(prefix="step-profile-")
    with tempfile.TemporaryDirectory() as tmp:
        names = [None] * batch
        if args.adapters:
            for i in range(args.adapters):
                path = write_random_adapter(f"{tmp}/a{i}", model_config, r=rank, alpha=2 * rank, seed=i)
                engine.lora_manager.register(f"a{i}", str(path))
            names = [f"a{i % args.adapters}" for i in range(batch)]
        engine.start()
        def decode_batch() -> tuple[int, float]:  # its decode steps and their mean wall time
            before = dict(engine.counters)
            engine.generate_batch([prompt] * batch, params, names)
            n = engine.counters["decode_steps"] - before["decode_steps"]
            return n, (engine.counters["decode_seconds"] - before["decode_seconds"]) / n

        try:
            engine.generate_batch([prompt] * batch, params, names)  # warm: adapters resident
            _, plain_s = decode_batch()  # the step time without the tracer's cost
            trace_dir = os.path.join(out_dir, "trace")
            with jax.profiler.trace(trace_dir):
                steps, step_s = decode_batch()
        finally:
            engine.shutdown()
    try:
        trace_file = newest_trace(trace_dir)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    profile = ProfileData.from_file(trace_file)
    events = op_events(profile)
    if not events:
        raise SystemExit(f"the trace {trace_file} holds no XLA op events")
    device_ns, kinds, ops = breakdown(events, steps)
    sampler_ns = busy_ns(step_programs(events, "sample")) / steps
    op_ns = sum(ns for _, ns in kinds)  # past device_ns where ops ran on several threads at once
    calls = calls_per_step(step_programs(events, "decode"), steps)
    rows = [(kind, f"{ns / 1e3:.1f}", f"{calls[kind]:.0f}", f"{ns / op_ns:.3f}") for kind, ns in kinds[: args.top]]
    rest = sum(ns for _, ns in kinds[args.top:])
    if rest:
        rows.append((f"({len(kinds) - args.top} more)", f"{rest / 1e3:.1f}",
                     f"{sum(calls[k] for k, _ in kinds[args.top:]):.0f}", f"{rest / op_ns:.3f}"))
    print(f"device={jax.devices()[0].platform} model={shape} dtype={dtype} batch={batch} adapters={args.adapters} "
          f"slots={engine.lora_manager.num_slots if engine.lora_manager is not None else 0} "
          f"decode steps={steps}; the forward's ops, per step (the sampler's program: {sampler_ns / 1e3:.1f} us)")
    print_table(["op", "us per step", "runs per step", "share"], rows)
    host_steps, host = host_parts(profile)
    if host:
        print(f"the engine thread's side of a decode step ({host_steps} steps, from the Python tracer, which "
              f"slows the host: read it for shares)")
        host_ns = sum(host.values())
        print_table(["part", "us per step", "share"],
                    [(part, f"{ns / 1e3:.1f}", f"{ns / host_ns:.3f}") for part, ns in host.items()])
    result = {"step_ms": 1e3 * step_s, "untraced_step_ms": 1e3 * plain_s, "device_ms": device_ns / 1e6,
              "device_share": device_ns / 1e9 / step_s,
              "top_op": kinds[0][0], "top_op_share": kinds[0][1] / op_ns}
    with open(os.path.join(out_dir, "step_profile.json"), "w") as f:
        json.dump({**result, "sampler_ms": sampler_ns / 1e6, "steps": steps, "shape": shape,
                   "kinds_us": {k: ns / 1e3 for k, ns in kinds}, "kinds_runs_per_step": calls,
                   "host_us": {k: ns / 1e3 for k, ns in host.items()},
                   "ops_us": {k: ns / 1e3 for k, ns in ops[:60]}}, f, indent=1, default=str)
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
