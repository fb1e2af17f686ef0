"""The launch/run-time profile of the GPU kernels runs end to end at tiny shapes (interpret
mode), and the code it times computes what the gather formulation computes."""

import json

import pytest

from benchmarks import kernel_profile


def test_kernel_profile_smoke(tmp_path, capsys):
    out = tmp_path / "profile.json"
    cases = "empty,xla_op,pair,single,gather"
    assert kernel_profile.main(["--smoke", "--cases", cases, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == set(cases.split(","))
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["wall_us"] > 0
    assert rows["pair"]["relerr_vs_gather"] < 1e-2
    assert rows["single"]["relerr_vs_gather"] < 1e-2
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("launch_floor_us=")


def test_kernel_profile_refuses_unknown_case():
    with pytest.raises(SystemExit):
        kernel_profile.main(["--smoke", "--cases", "pair,bogus"])
