"""The serving workload sent to engines in process, at a tiny setting."""

import json
import re

import pytest

from benchmarks import engine_serving
from benchmarks.engine_serving import EngineRun
from benchmarks.serving_workload import RunSummary, WorkloadSpec


def test_it_serves_the_workload_on_both_engines(capsys, tmp_path):
    line = engine_serving.main(["--trace-dir", str(tmp_path), "--adapters", "4", "--slots", "2", "--max-batch", "4",
                                "--requests", "8",
                                "--rates", "8", "32", "--duration", "2", "--input-len", "4", "6",
                                "--output-len", "2", "4", "--trace-rate", "32"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == line
    values = dict(re.findall(r"(\w+)=(\S+)", line))
    assert set(values) == {"lora_over_base_throughput", "ttft_p99_ms", "tpot_p99_ms", "slot_loads_per_request",
                           "compiles_after_warmup"}
    assert float(values["lora_over_base_throughput"]) > 0 and float(values["ttft_p99_ms"]) > 0
    assert values["compiles_after_warmup"] == "0"  # adapter churn and every batch shape compiled in warm-up
    rows = [row.split() for row in out if row.split()[:1] in (["base"], ["adapters"])]
    assert sorted((r[0], float(r[1])) for r in rows) == [("adapters", 8.0), ("adapters", 32.0), ("base", 8.0),
                                                         ("base", 32.0)]
    assert all(r[3] == "0" for r in rows), rows  # no errors
    # Four adapters through two slots: the runs load adapters into slots.
    assert sum(int(r[15]) for r in rows if r[0] == "adapters") > 0
    # A run that loaded adapters had requests wait in the queue for those loads (slot wait ms).
    assert all(float(r[16]) > 0 for r in rows if r[0] == "adapters" and int(r[15]) > 0), rows
    assert all(r[15:] == ["-", "-"] for r in rows if r[0] == "base"), rows
    assert all(0 < float(r[11]) <= 4 for r in rows), rows  # mean decode rows, at most max_batch
    # Every run decoded and ran prompts (8 requests of 4-6 prompt tokens: at least two prompt steps
    # at 4 rows), and its steps took time.
    assert all(float(r[12]) > 0 and int(r[13]) >= 2 and float(r[14]) > 0 for r in rows), rows
    # The runs at 32 req/s were traced: each engine's table counts one decode program run a decode
    # step, and the LoRA engine's one slot write a slot load.
    traced = [i for i, row in enumerate(out) if row.startswith("the trace of the ")]
    assert [out[i].split()[4] for i in traced] == ["base", "adapters"], out
    for i, (system, rate) in zip(traced, [("base", 32.0), ("adapters", 32.0)]):
        end = next(j for j in range(i + 2, len(out)) if not out[j].strip() or out[j].startswith(("the ", "last ")))
        table = {row.split()[0]: row.split() for row in out[i + 2:end]}
        run = next(r for r in rows if (r[0], float(r[1])) == (system, rate))
        steps, run_steps = map(int, re.search(r"(\d+) decode steps \(the run: (\d+),", out[i]).groups())
        # the whole run traced: the trace's decode programs are the engine's decode steps
        assert steps > 0 and int(table["jit_decode"][1]) == steps == run_steps, (out[i], table)
        if system == "adapters":
            assert int(table["jit__set_slot"][1]) == int(run[15]), table
        summary = json.loads((tmp_path / system / "summary.json").read_text())
        decode = next(p for p in summary["programs"] if p["name"] == "jit_decode")
        assert decode["runs"] == steps and decode["top_texts"] and decode["busy_ns"] <= summary["window_ns"]


def _run(system: str, rate: float, rps: float, ttft_p99_ms: float, loads: int = 0) -> EngineRun:
    spec = WorkloadSpec(8, 1.0, rate, 10, 5.0, (4, 6), (2, 4), 0)
    s = RunSummary(requests=10, errors=0, requests_per_s=rps, output_tokens_per_s=1.0, ttft_p50_ms=1.0,
                   ttft_p99_ms=ttft_p99_ms, tpot_p50_ms=1.0, tpot_p99_ms=2.0, slo_attainment=1.0)
    return EngineRun(system, spec, s, loads)


def test_the_last_line_is_at_the_highest_rate_within_the_ttft_bound():
    runs = [_run("base", 4.0, 4.0, 10.0), _run("adapters", 4.0, 4.0, 20.0, 3),
            _run("base", 16.0, 10.0, 900.0), _run("adapters", 16.0, 8.0, 1500.0, 5),
            _run("base", 64.0, 10.0, 5000.0), _run("adapters", 64.0, 8.0, 9000.0, 9)]
    line, note = engine_serving.headline(runs, slo_ttft_s=2.0, compiles=0)
    assert line == ("lora_over_base_throughput=0.8000 ttft_p99_ms=1500.00 tpot_p99_ms=2.00 "
                    "slot_loads_per_request=0.5000 compiles_after_warmup=0")
    assert note == "last line at 16.0 req/s"
    line, note = engine_serving.headline([_run("base", 4.0, 4.0, 10.0), _run("adapters", 4.0, 2.0, 3000.0)],
                                         slo_ttft_s=2.0, compiles=1)
    assert line.startswith("lora_over_base_throughput=0.5000") and "compiles_after_warmup=1" in line
    assert "no rate kept" in note


@pytest.mark.parametrize("bad", [["--rates", "0"], ["--slots", "0"], ["--input-len", "5", "4"],
                                 ["--output-len", "1", "3"], ["--rates", "8", "--trace-rate", "16"],
                                 ["--trace-window", "1", "0"], ["--trace-window", "-1", "2"]])
def test_bad_flags_are_refused(bad):
    with pytest.raises(SystemExit):
        engine_serving.parse_args(bad)
