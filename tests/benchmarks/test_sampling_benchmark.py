"""benchmarks.sampling keeps running, and its last line names every mode."""

from benchmarks import sampling


def test_quick_run_prints_every_mode_last(capsys):
    assert sampling.main(["--quick", "--batch", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    values = dict(pair.split("=") for pair in last.split())
    assert set(values) == {f"{m}_ms" for m in [*sampling.MODES, "top_p_flat", "top_p_one_flat"]}
    assert "min_p_ms" in values and all(float(v) > 0 for v in values.values())
