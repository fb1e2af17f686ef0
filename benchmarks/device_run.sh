#!/usr/bin/env bash
# The one accelerator run: kernel checks and benchmarks, then engine benchmarks on the
# device. Run from the repository root; outputs go to $OUT (default ./.device_out).
# Wheels for packages the device image lacks (pydantic) may sit in .whl/.
set -uo pipefail
OUT=${OUT:-./.device_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
smoke=${1:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
timeout 270 python3 benchmarks/device_check.py ${smoke:+--cpu-smoke} --budget-s 235 --out "$OUT" 2>&1 | tee "$OUT/device_check.log"
large=--large
[ -n "$smoke" ] && large=
for backend in pallas xla; do
  timeout 80 python3 -m benchmarks.multi_lora --quick $large --backend "$backend" 2>&1 | tee "$OUT/multi_lora_$backend.log" | tail -9
done
timeout 60 python3 -m benchmarks.engine_throughput --quick --dtype bfloat16 2>&1 | tee "$OUT/engine_throughput.log" | tail -6
