#!/usr/bin/env bash
# The accelerator runs, from the repository root; outputs go to $OUT (default ./.device_out).
#   bash benchmarks/device_run.sh          full: kernel checks, sweep, stack, benchmarks, engine
#   bash benchmarks/device_run.sh smoke    the same at tiny shapes in interpret mode (any machine)
#   bash benchmarks/device_run.sh kernels  the kernel benchmark as a scan and unrolled, then the
#                                          engine's LoRA step with the kernel and XLA backends
# Wheels for packages the device image lacks (pydantic) may sit in .whl/.
set -uo pipefail
OUT=${OUT:-./.device_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mode=${1:-full}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
if [ "$mode" = kernels ]; then
  timeout 55 python3 -m benchmarks.lora_kernels 2>&1 | tee "$OUT/lora_kernels_scan.log"
  timeout 55 python3 -m benchmarks.lora_kernels --unrolled 2>&1 | tee "$OUT/lora_kernels_unrolled.log"
  for backend in pallas xla; do
    timeout 60 python3 -m benchmarks.multi_lora --quick --large --backend "$backend" 2>&1 \
      | tee "$OUT/multi_lora_$backend.log" | tail -9
  done
  exit 0
fi
smoke=
[ "$mode" = smoke ] && smoke=1
timeout 270 python3 benchmarks/device_check.py ${smoke:+--cpu-smoke} --budget-s 235 --out "$OUT" 2>&1 | tee "$OUT/device_check.log"
large=--large
[ -n "$smoke" ] && large=
for backend in pallas xla; do
  timeout 80 python3 -m benchmarks.multi_lora --quick $large --backend "$backend" 2>&1 | tee "$OUT/multi_lora_$backend.log" | tail -9
done
timeout 60 python3 -m benchmarks.engine_throughput --quick --dtype bfloat16 2>&1 | tee "$OUT/engine_throughput.log" | tail -6
