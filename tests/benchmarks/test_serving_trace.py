"""A serving trace split by program: device time and the idle time before each program's runs."""

import pytest

from benchmarks.serving_trace import (
    ProgramTime,
    kept_texts,
    op_lines,
    program_name,
    read_trace,
    summarize_ops,
    table_rows,
    traced,
)


def _op(program, run, start, end):
    return {"program": program, "run": run, "kind": "op", "text": "op", "ns": float(end - start), "start": start,
            "end": end}


def test_programs_get_their_runs_busy_time_and_the_idle_time_before_them():
    events = [
        _op("jit_decode(3)", 1, 0, 100), _op("jit_decode(3)", 1, 0, 80),  # two threads at once
        _op("jit_sample(4)", 2, 100, 110),
        _op("jit__set_slot(9)", 3, 150, 160),  # 40 idle before it
        _op("jit_decode(3)", 4, 160, 250), _op("jit_decode(3)", 4, 270, 300),  # 20 idle inside the run
        _op("jit_sample(4)", 5, 310, 320),  # 10 idle before it
        _op("jit_decode(7)", 6, 400, 500),  # the same function recompiled: 80 idle before it
    ]
    s = summarize_ops(events)
    assert s.window_ns == 500 and s.busy_ns == 100 + 10 + 10 + 90 + 30 + 10 + 100 and s.idle_ns == 150
    by_name = {p.name: p for p in s.programs}
    assert by_name == {"jit_decode": ProgramTime("jit_decode", 3, 320.0, 80.0, (("op", 400.0),), (("op", 400.0),)),
                       "jit_sample": ProgramTime("jit_sample", 2, 20.0, 10.0, (("op", 20.0),), (("op", 20.0),)),
                       "jit__set_slot": ProgramTime("jit__set_slot", 1, 10.0, 40.0, (("op", 10.0),), (("op", 10.0),))}
    assert [p.name for p in s.programs] == ["jit_decode", "jit_sample", "jit__set_slot"]  # most busy first
    rows = table_rows(s, decode_steps=2, top=2)
    assert rows[0] == ["jit_decode", 3, "1.50", "0.000", "0.000", "0.000"]
    assert rows[2][0] == "1 others" and rows[2][1] == 1
    assert rows[-1][0] == "(window)"
    assert op_lines(s, top=1) == ["jit_decode, ms a run: op 0.000"]


def test_the_summary_keeps_the_texts_of_the_busiest_kinds_and_of_every_data_move():
    def op(kind, text, start, end):
        return {"program": "jit_decode(1)", "run": 1, "kind": kind, "text": text, "ns": float(end - start),
                "start": start, "end": end}

    ops = [op(f"fusion{i}", f"%fusion{i}.1 = f32[8]", 10 * i, 10 * i + 9) for i in range(12)]
    ops += [op("fusion0", f"%fusion0.{i} = f32[{i}]", 200 + i, 201 + i) for i in range(2, 6)]
    ops.append(op("slice-done", "%slice-done.3 = bf16[63,48,4096] slice-done(%slice-start.3)", 300, 301))
    texts = [t for t, _ in kept_texts(ops)]
    assert "%slice-done.3 = bf16[63,48,4096] slice-done(%slice-start.3)" in texts  # a move, however short
    assert sum(t.startswith("%fusion0.") for t in texts) == 3  # three texts of a kind
    assert len(texts) == 3 + 7 + 1  # fusion0's 3, one each of the 7 next busiest kinds, the move
    assert [ns for _, ns in kept_texts(ops)] == sorted((ns for _, ns in kept_texts(ops)), reverse=True)


def test_a_window_traces_only_its_seconds_of_the_body(tmp_path):
    import time

    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    step(x).block_until_ready()
    calls, start = 0, time.perf_counter()
    with traced(str(tmp_path / "w"), window=(0.4, 0.3)):
        while time.perf_counter() - start < 1.2:
            step(x).block_until_ready()
            calls += 1
    summary = read_trace(str(tmp_path / "w"))
    runs = sum(p.runs for p in summary.programs if "lambda" in p.name)
    assert 0 < runs < calls / 2, (runs, calls)  # 0.3 s of 1.2
    assert summary.window_ns < 0.6e9
    # A body that ends before the window opens leaves no op events.
    with traced(str(tmp_path / "late"), window=(5.0, 1.0)):
        step(x).block_until_ready()
    with pytest.raises((ValueError, FileNotFoundError)):
        read_trace(str(tmp_path / "late"))


def test_program_names_drop_the_id_and_an_empty_trace_is_an_error():
    assert program_name("jit_decode(12)") == "jit_decode"
    assert program_name("jit__lambda") == "jit__lambda"
    with pytest.raises(ValueError, match="no XLA op events"):
        summarize_ops([])
