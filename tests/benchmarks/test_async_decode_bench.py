"""benchmarks.async_decode keeps running: four engines, a step time each, nothing compiled
after warm-up."""

from __future__ import annotations

from benchmarks import async_decode


def test_the_benchmark_times_both_ways_and_compiles_nothing_after_warmup(capsys):
    result = async_decode.main(["--tiny", "--new-tokens", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("async_over_sync_lora_off=")
    assert "8 adapters" in out and "LoRA off" in out
    assert result["compiles_after_warmup"] == 0
