"""The TPU run's Python steps run end to end on CPU, so an accelerator run is never spent on a
script that breaks: the KV write / read comparison and the whole-engine check."""

import json

from benchmarks import engine_device_check, kv_write


def test_kv_write_compares_the_formulations(capsys):
    kv_write.main(["--cache-gib", "0.01", "--dtype", "float32", "--tokens", "8", "--rounds", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines if line.split()[0] in ("write", "read")]
    assert len(rows) == 4  # two writes of 8 tokens, two reads (the Mosaic write only on a TPU)
    assert all(r[-1] == "True" for r in rows if r[0] == "write")  # every write gave the same cache
    last = dict(kv.split("=") for kv in lines[-1].split())
    assert set(last) == {"write_temp_over_cache", "read_temp_over_cache", "write_us_per_layer",
                         "read_us_per_layer"}
    assert float(last["write_temp_over_cache"]) < 0.05  # in place: no copy of the cache


def test_engine_device_check_on_cpu(tmp_path, capsys, monkeypatch):
    assert engine_device_check.configurations("cpu") == [("xla", "xla"), ("reference", "xla")]
    assert ("pallas", "pallas") in engine_device_check.configurations("tpu")
    # Two engines compared as on a device; the XLA backend twice (the reference one warms up slowly).
    monkeypatch.setattr(engine_device_check, "configurations", lambda platform: [("xla", "xla"), ("xla", "auto")])
    out = tmp_path / "engine.json"
    assert engine_device_check.main(["--words", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lora_backend"], r["attention_backend"]) for r in rows] == [("xla", "xla"), ("xla", "auto")]
    assert all(r["task_accuracy"] == 1.0 and r["compiles_after_warmup"] == 0 and r["again_same"] for r in rows)
    assert rows[0]["tokens"] == rows[1]["tokens"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("configs=2/2 task_accuracy_min=1.000 token_mismatches=0 compiles_after_warmup=0")
