"""Where the device's time goes while an engine serves: a profiler trace of a whole serving run read
back as programs, the time each kept the device busy, and the time the device sat idle before each.

A decode step's wall time in serving can exceed the same step's alone (benchmarks/step_profile.py)
for three reasons: other programs run between decode steps (prompt steps, adapter slot writes,
input copies), the decode program itself runs longer (more distinct adapters, longer contexts), or
the device waits for the host. This splits the traced window into those: per program, its runs,
its device time (the union of its ops' intervals) and the idle time just before its runs (the
device had nothing queued: it waited for the host to launch that program).

Used by `benchmarks.engine_serving --trace-rate R`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import jax
from jax.profiler import ProfileData

from benchmarks.step_profile import busy_ns, newest_trace, op_events, per_step

_PROGRAM_ID = re.compile(r"\(\d+\)$")
TOP_OPS = 8  # op kinds kept per program
TEXTS_PER_KIND = 3  # ops kept by their HLO text (a TPU trace's text holds the shapes) for each kind kept
# Op kinds whose texts are kept whatever their time: data movement an XLA program schedules itself
# (asynchronous slices and copies: what they move is in their text).
MOVES = re.compile(r"slice|copy")


@dataclasses.dataclass(frozen=True)
class ProgramTime:
    name: str  # the jitted function's name, e.g. `jit_decode`
    runs: int
    busy_ns: float  # the union of its ops' intervals over the window
    idle_before_ns: float  # device idle time just before its runs (nothing else ran in between)
    top_ops: tuple[tuple[str, float], ...] = ()  # (op kind, ns summed over its runs), most first
    # (op's HLO text, ns summed over its runs): the busiest few of each top kind and of every kind
    # that moves data (MOVES), most first
    top_texts: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    window_ns: float  # from the first op's start to the last op's end
    busy_ns: float  # the union of every op's interval
    programs: tuple[ProgramTime, ...]  # most busy first

    @property
    def idle_ns(self) -> float:
        return self.window_ns - self.busy_ns


def program_name(program: str) -> str:
    """A program's name without its id: `jit_decode(12)` -> `jit_decode`."""
    return _PROGRAM_ID.sub("", program)


def summarize_ops(events: list[dict]) -> TraceSummary:
    """The trace's op events (step_profile.op_events) per program. A run's idle-before is the gap
    between the end of every op that started before the run's first op and that first op."""
    if not events:
        raise ValueError("the trace holds no XLA op events")
    runs: dict[tuple[str, object], list[dict]] = {}
    for e in events:
        runs.setdefault((program_name(e["program"]), e["run"]), []).append(e)
    firsts = sorted((min(ops, key=lambda e: e["start"])["start"], name) for (name, _), ops in runs.items())
    ends = sorted((e["start"], e["end"]) for e in events)
    idle: dict[str, float] = {}
    reach, i = float("-inf"), 0
    for start, name in firsts:  # reach: the latest end of the ops that started before this run
        while i < len(ends) and ends[i][0] < start:
            reach = max(reach, ends[i][1])
            i += 1
        idle[name] = idle.get(name, 0.0) + (max(0.0, start - reach) if reach > float("-inf") else 0.0)
    programs = []
    for name in {name for name, _ in runs}:
        ops = [e for (n, _), run_ops in runs.items() if n == name for e in run_ops]
        programs.append(ProgramTime(name, sum(1 for n, _ in runs if n == name), busy_ns(ops), idle[name],
                                    tuple(per_step(ops, "kind", 1)[:TOP_OPS]),
                                    kept_texts(ops)))
    window = max(e["end"] for e in events) - min(e["start"] for e in events)
    return TraceSummary(float(window), busy_ns(events), tuple(sorted(programs, key=lambda p: -p.busy_ns)))


def kept_texts(ops: list[dict]) -> tuple[tuple[str, float], ...]:
    """The op texts a program's summary keeps (ProgramTime.top_texts)."""
    kinds = [kind for kind, _ in per_step(ops, "kind", 1)]
    keep = set(kinds[:TOP_OPS]) | {kind for kind in kinds if MOVES.search(kind)}
    texts = []
    for kind in keep:
        texts += per_step([e for e in ops if e["kind"] == kind], "text", 1)[:TEXTS_PER_KIND]
    return tuple(sorted(texts, key=lambda kv: -kv[1]))


def trace_options() -> jax.profiler.ProfileOptions:
    """Device and runtime events without the Python tracer (it slows the host's side of a step
    2-3x on the TPU host, which would change what is measured)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


@contextmanager
def traced(directory: str, window: tuple[float, float] | None = None) -> Iterator[None]:
    """Runs the body under the profiler, writing the trace under `directory`: all of it, or with
    `window` = (after_s, seconds) from `after_s` into the body for `seconds` at most (a bounded
    trace of a long run; the profiler writes it out in time proportional to its events). A body
    that ends before `after_s` leaves an empty trace."""
    if window is None:
        with jax.profiler.trace(directory, profiler_options=trace_options()):
            yield
        return
    after_s, seconds = window
    done = threading.Event()  # the body ended

    def trace() -> None:
        done.wait(after_s)
        jax.profiler.start_trace(directory, profiler_options=trace_options())
        try:
            done.wait(seconds)
        finally:
            jax.profiler.stop_trace()

    tracer = threading.Thread(target=trace, name="serving-trace", daemon=True)
    tracer.start()
    try:
        yield
    finally:
        done.set()
        tracer.join()


def decode_runs(summary: TraceSummary) -> int:
    """The decode steps the trace holds: the runs of the decode programs (`jit_decode` when read
    from the engine's program store, `jit__decode_impl` when traced)."""
    return sum(p.runs for p in summary.programs if "decode" in p.name)


def read_trace(directory: str) -> TraceSummary:
    """The newest trace written under `directory`, summarized."""
    return summarize_ops(op_events(ProfileData.from_file(newest_trace(directory))))


def write_summary(summary: TraceSummary, path: str) -> None:
    """The summary as JSON (program times, top op kinds and HLO texts)."""
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(summary), f, indent=1)


def op_lines(summary: TraceSummary, top: int = 2) -> list[str]:
    """For the `top` busiest programs, their busiest op kinds in ms a run (op times add up past the
    program's busy time where ops run at once)."""
    return [f"{p.name}, ms a run: " + ", ".join(f"{kind} {ns / p.runs / 1e6:.3f}" for kind, ns in p.top_ops)
            for p in summary.programs[:top]]


def table_rows(summary: TraceSummary, decode_steps: int, top: int = 8) -> list[list]:
    """Rows of [program, runs, runs a decode step, device ms a run, device ms a decode step, idle ms
    before it a decode step]: the `top` busiest programs, the rest together, and the idle time not
    before any run."""
    n = max(1, decode_steps)
    rows = [[p.name, p.runs, f"{p.runs / n:.2f}", f"{p.busy_ns / p.runs / 1e6:.3f}", f"{p.busy_ns / n / 1e6:.3f}",
             f"{p.idle_before_ns / n / 1e6:.3f}"] for p in summary.programs[:top]]
    rest = summary.programs[top:]
    if rest:
        runs = sum(p.runs for p in rest)
        busy, idle = sum(p.busy_ns for p in rest), sum(p.idle_before_ns for p in rest)
        rows.append([f"{len(rest)} others", runs, f"{runs / n:.2f}", f"{busy / max(1, runs) / 1e6:.3f}",
                     f"{busy / n / 1e6:.3f}", f"{idle / n / 1e6:.3f}"])
    overlap = sum(p.busy_ns for p in summary.programs) - summary.busy_ns  # programs that ran at once
    idle = f"{summary.idle_ns / n / 1e6:.3f}" + (f" ({overlap / n / 1e6:.3f} overlapped)" if overlap > 0 else "")
    rows.append(["(window)", "", "", "", f"{summary.window_ns / n / 1e6:.3f}", idle])
    return rows
