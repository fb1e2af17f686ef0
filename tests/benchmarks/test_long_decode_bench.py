"""benchmarks.long_decode keeps running: a long-context batch decodes, its step is timed
against the bytes it reads, nothing compiled after warm-up."""

from __future__ import annotations

from benchmarks import long_decode


def test_the_benchmark_times_a_long_context_step_and_compiles_nothing_after_warmup(capsys):
    result = long_decode.main(["--tiny", "--batch", "4", "--context", "200", "--new-tokens", "6", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("step_ms_xla=") and "bytes_roofline_ms=" in lines[-1]
    assert "context=200" in lines[0]
    assert result["step_ms_xla"] > 0 and result["bytes_roofline_ms"] > 0
    assert result["compiles_after_warmup"] == 0
