"""The decode-step profile at a tiny setting, and how it reads a trace's op events."""

import json
import re
from types import SimpleNamespace

from benchmarks import step_profile


def test_it_profiles_a_tiny_engines_decode_step(tmp_path, capsys):
    step_profile.main(["--batch", "4", "--adapters", "2", "--new-tokens", "6", "--out", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    values = dict(re.findall(r"(\w+)=(\S+)", out[-1]))
    assert set(values) == {"step_ms", "untraced_step_ms", "device_ms", "device_share", "top_op", "top_op_share"}
    # The forward's own op time fits in the step that waits for it; the ops it lists are leaves,
    # so a loop's event and its body's ops are not both counted.
    assert float(values["step_ms"]) > 0 and float(values["untraced_step_ms"]) > 0
    assert 0 < float(values["device_share"]) <= 1.05
    assert 0 < float(values["top_op_share"]) <= 1
    assert "batch=4 adapters=2 slots=4 decode steps=" in out[0] and "the sampler's program" in out[0]
    summary = json.loads((tmp_path / "step_profile.json").read_text())
    # The engine thread's side of the steps, from the Python tracer: every part of a step seen.
    assert set(summary["host_us"]) == {*step_profile.HOST_PARTS.values(), step_profile.OTHER_PART}
    assert summary["host_us"]["wait for the tokens (device, copy back)"] > 0
    # Every op kind with time ran at least once a step on average, and a whole number of times over them.
    runs = summary["kinds_runs_per_step"]
    assert set(runs) == set(summary["kinds_us"]) and all(n > 0 for n in runs.values())
    steps = summary["steps"]
    assert all(abs(n * steps - round(n * steps)) < 1e-6 for n in runs.values())


def test_a_decode_step_splits_by_its_outermost_parts():
    events = [(0, 100, "$engine.py:847 _decode"), (0, 10, "$engine.py:756 _paged_inputs"),
              (12, 30, "$runner.py:380 dispatch_decode"), (12, 15, "$runner.py:186 op_forward"),
              (13, 14, "$program_store.py:106 call"), (15, 25, "$engine.py:857 while_forward"),
              (25, 30, "$runner.py:204 op_sample"), (30, 80, "$runner.py:77 get"), (31, 79, "$runner.py:77 get"),
              (85, 90, "$<unknown> get"),  # another `get`: not the wait for the tokens
              (150, 160, "$runner.py:77 get"),  # between steps: no part of either
              (200, 300, "$engine.py:847 _decode"), (200, 220, "$engine.py:756 _paged_inputs"),
              (230, 290, "$runner.py:77 get")]
    assert step_profile._function("$runner.py:77 get") == "runner.py get"
    steps, parts = step_profile.split_steps([(s, e, step_profile._function(n)) for s, e, n in events])
    names = dict(zip(["inputs", "forward", "work", "sampler", "wait"], step_profile.HOST_PARTS.values()))
    assert steps == 2
    assert parts == {names["inputs"]: 15.0, names["forward"]: 1.5, names["work"]: 5.0, names["sampler"]: 2.5,
                     names["wait"]: 55.0, step_profile.OTHER_PART: 21.0}


def test_op_kind_reads_tpu_and_cpu_names():
    tpu = "%fusion.106 = bf16[8,4096]{1,0:T(8,128)(2,1)S(1)} fusion(bf16[8,4096] %x), kind=kOutput"
    assert step_profile.op_kind(tpu) == "fusion"
    assert step_profile.op_kind("%slice-done.15 = bf16[2,8] async-done(%slice-start.15)") == "slice-done"
    assert step_profile.op_kind("dynamic-slice_bitcast_fusion.3") == "dynamic-slice_bitcast_fusion"
    assert step_profile.op_kind("kv_write") == "kv_write"


def test_enclosing_events_are_not_counted():
    ev = lambda s, e: SimpleNamespace(start_ns=s, end_ns=e)  # noqa: E731
    loop, a, b, after = ev(0, 100), ev(10, 40), ev(50, 90), ev(100, 120)
    assert step_profile._leaves([after, b, loop, a]) == [a, b, after]


def test_the_forward_is_the_decode_programs_busy_time_per_step():
    def ev(program, kind, start, end):
        return {"program": program, "kind": kind, "text": kind, "ns": float(end - start), "start": start, "end": end}

    # Two steps; in each the forward runs two ops at once on two threads, then one alone.
    step = "jit_decode(7)"
    events = [ev(step, "dot", 0, 100), ev(step, "dot", 0, 100), ev(step, "add", 100, 110),
              ev(step, "dot", 500, 600), ev(step, "dot", 500, 600), ev(step, "add", 600, 610),
              ev("jit_sample(8)", "sort", 110, 150), ev("jit__prefill_impl(3)", "dot", 200, 400)]
    busy, kinds, ops = step_profile.breakdown(events, steps=2)
    assert busy == 110.0 and kinds == [("dot", 200.0), ("add", 10.0)]
    assert step_profile.busy_ns(step_profile.step_programs(events, "sample")) == 40.0
