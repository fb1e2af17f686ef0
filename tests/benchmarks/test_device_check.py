"""The accelerator script runs end to end at tiny shapes (interpret mode), so a device run
is never spent on a script that breaks: every kernel case passes, every GPU kernel and sweep
configuration lowers for CUDA, and each section records its rows."""

import json

from benchmarks import device_check


def test_device_check_cpu_smoke(tmp_path):
    assert device_check.main(["--cpu-smoke", "--budget-s", "300", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "device_check.json").read_text())
    sections = record["sections"]
    assert sections["env"]["add_kernel_ok"] is True
    layouts = sections["layouts"]["rows"]  # the pool arrays' stored layouts (on CPU: rows exact, none off)
    assert [(r["rank"], r["rows"]) for r in layouts] == [(4, 4), (4, 4), (8, 8), (16, 16), (16, 16)]
    assert all(r["arrays"] > 0 and r["off"] == [] for r in layouts)
    lowering = sections["cuda_lowering"]
    assert lowering["passed"] == lowering["total"] > 0, [r for r in lowering["rows"] if not r["ok"]]
    correctness = sections["correctness"]
    assert correctness["passed"] == correctness["total"] > 0, [r for r in correctness["rows"] if not r["ok"]]
    assert any(r["block"]["single_launch"] for r in sections["sweep"]["rows"] if "us_per_layer" in r)
    assert sections["sweep"]["best"]["us_per_layer"] > 0
    assert all("kernel_us" in r for r in sections["stack"]["rows"])
    assert sections["benchmark"]["summary"].startswith("speedup_vs_onehot=")
    assert set(record["targets"]) == {
        "bandwidth_fraction>=0.6 at T>=64", ">=3x faster than one-hot at S=64",
        "faster than gather at every shape", "stack ratio within 1.15x of roofline",
    }


def test_tpu_stack_runs_decode_through_the_tuned_kernels(tmp_path):
    """On TPU the stack's kernel column is the decode batch through bgmv's TPU path as tuned
    (kernels.bgmv.tuned_block_sizes: the slot-loop kernels), with the same result as the XLA
    formulations."""
    assert device_check.main(["--cpu-smoke", "--platform", "tpu", "--sections", "env,stack", "--budget-s", "200",
                              "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "device_check.json").read_text())["sections"]["stack"]["rows"]
    assert rows and all(r["kernel_relerr"] < 1e-2 and r["kernel_unhoisted_relerr"] < 1e-2 for r in rows)
