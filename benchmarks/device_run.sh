#!/usr/bin/env bash
# The accelerator runs, from the repository root; outputs go to $OUT (default ./.device_out).
#   bash benchmarks/device_run.sh          full: kernel checks, sweep, stack, benchmarks, engine
#   bash benchmarks/device_run.sh smoke    the same at tiny shapes in interpret mode (any machine)
#   bash benchmarks/device_run.sh kernels  the kernel benchmark as a scan and unrolled, then the
#                                          engine's LoRA step with the kernel and XLA backends
#   bash benchmarks/device_run.sh profile  where a layer's time goes (benchmarks/kernel_profile.py:
#                                          launch floor, kernel time from a profiler trace, gaps),
#                                          with XLA's command buffers (CUDA graphs) as they are, with
#                                          the Pallas calls captured too, and off; then the headline
#                                          benchmark with and without that capture, and the engine
#                                          step with no command buffers (about 4-5 minutes)
#   bash benchmarks/device_run.sh restart  engine starts (benchmarks/engine_scale.py --start-only): a whole
#                                          Llama-3-8B-shaped model (32 layers, bfloat16) started over an
#                                          empty compilation cache, then over that cache; then 4- and
#                                          32-layer warm-ups at 8B widths (4 fresh processes, minutes)
#   bash benchmarks/device_run.sh restart-smoke  the same at small widths, on any machine
# Wheels for packages the device image lacks (pydantic, llguidance) go in .whl/ with
# scripts/device_wheels.sh; a run that starts an engine carries .whl.
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
echo "kernel $(uname -r)" | tee -a "$OUT/gpu.txt"  # which runtime: gVisor reports 4.4.0
if [ "$mode" = profile ]; then
  capture="--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
  timeout 75 python3 -m benchmarks.kernel_profile --out "$OUT/profile_default.json" 2>&1 \
    | tee "$OUT/profile_default.log"
  XLA_FLAGS="$capture" timeout 75 python3 -m benchmarks.kernel_profile --out "$OUT/profile_capture.json" 2>&1 \
    | tee "$OUT/profile_capture.log"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 75 python3 -m benchmarks.kernel_profile \
    --out "$OUT/profile_no_graphs.json" 2>&1 | tee "$OUT/profile_no_graphs.log"
  timeout 40 python3 -m benchmarks.lora_kernels --headline --unrolled 2>&1 | tee "$OUT/headline_default.log"
  XLA_FLAGS="$capture" timeout 40 python3 -m benchmarks.lora_kernels --headline --unrolled 2>&1 \
    | tee "$OUT/headline_capture.log"
  # The engine step with no command buffers at all: each Pallas call splits XLA's graphs.
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 80 python3 -m benchmarks.multi_lora --quick --large \
    --backend pallas 2>&1 | tee "$OUT/multi_lora_pallas_no_graphs.log" | tail -9
  exit 0
fi
if [ "$mode" = restart ] || [ "$mode" = restart-smoke ]; then
  widths=8b layers=32 dtype=bfloat16
  [ "$mode" = restart-smoke ] && widths=small layers=4 dtype=float32
  timeout 540 python3 -m benchmarks.engine_scale --start-only --layers "$layers" --dtype "$dtype" \
    --widths "$widths" --depth-widths "$widths" 2>&1 | tee "$OUT/engine_starts.log" | tail -9
  exit 0
fi
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
