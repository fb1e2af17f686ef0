"""The engine_scale benchmark's starts at a tiny setting, so they keep working: a replica's
start in a fresh process over an empty compilation cache, then its restart over what that
start left there."""

import re

import pytest

from benchmarks import engine_scale


def test_a_cached_restart_compiles_nothing_and_warms_up_faster(capsys):
    engine_scale.main(["--start-only", "--widths", "small", "--no-depth", "--layers", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    values = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", out[-1])}
    assert set(values) == {"warm_start_s", "cached_start_s", "cached_speedup", "cached_warmup_speedup"}
    # The restart reads every executable and step program from the cache: its warm-up,
    # which otherwise compiles them all, is several times shorter.
    assert values["cached_warmup_speedup"] > 2, out
    assert values["cached_start_s"] < values["warm_start_s"]
    cached = next(line for line in out if line.strip().startswith("cache from the run before"))
    compiled, hits = cached.split()[-4:-2]
    assert compiled == "0" and int(hits) > 0, cached


@pytest.mark.parametrize("flag", ["--pin-cores", "--unstreamed"])
def test_http_flags_need_the_http_comparison_alone(flag):
    with pytest.raises(SystemExit):
        engine_scale.main([flag])
