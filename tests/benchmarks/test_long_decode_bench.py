"""benchmarks.long_decode keeps running: a long-context batch decodes with LoRA off and with
adapters, its step is timed against the bytes it reads, nothing compiled after warm-up."""

from __future__ import annotations

from benchmarks import long_decode


def test_the_benchmark_times_a_long_context_step_with_and_without_adapters(capsys):
    result = long_decode.main(["--tiny", "--batch", "2", "--context", "130", "--new-tokens", "4", "--repeats", "1",
                               "--adapters", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("step_ms_xla=") and "bytes_roofline_ms=" in lines[-1]
    assert "context=130" in lines[0]
    assert result["step_ms_xla"] > 0 and result["bytes_roofline_ms"] > 0
    assert "xla+2 adapters" in "\n".join(lines)
    # The adapters' bytes raise the roofline; both engines timed a step.
    assert result["lora_roofline_ratio"] > 1.0
    assert result["lora_over_base"] > 0
    assert result["compiles_after_warmup"] == 0
