#!/usr/bin/env bash
# The TPU runs (one chip, Python 3.11, JAX preinstalled, no network), from the repository root;
# outputs go to $OUT (default ./.device_out). One call may run several modes in order:
#   bash benchmarks/tpu_run.sh MODE [MODE ...]
#   check        the Mosaic kernels against float64 / dense references, their block sweep, speed
#                against the XLA formulations and the byte roofline (32-layer stacks of decode
#                batches; benchmarks/device_check.py; about 4 minutes)
#   correctness  the adapter pool's stored layouts, the kernels' and paged attention's correctness (about two minutes)
#   kv           the KV write and page read compiled for the chip (benchmarks/kv_write.py)
#   engine       the engine on the demo model through the kernels and through XLA
#                (benchmarks/engine_device_check.py; about 2 minutes)
#   steps        the LoRA decode step at Llama-3-8B layer widths (8 layers, bfloat16) through the
#                kernels and through XLA (benchmarks/multi_lora.py; about 3 minutes)
#   async        decode steps with async_decode on and off, LoRA off and 8 adapters, at Llama-3-8B
#                layer widths (benchmarks/async_decode.py; about 4 minutes)
#   long         decode at long contexts (64 sequences of 2048 tokens, 8 layers of Llama-3-8B widths,
#                bfloat16), the Pallas kernels against XLA's attention, and the Pallas engine with 8
#                rank-16 adapters (benchmarks/long_decode.py; three engines started cold; about 3 minutes)
#   starts       engine starts (benchmarks/engine_scale.py --start-only): 4- and 32-layer warm-ups,
#                then 8 layers of Llama-3-8B widths in bfloat16 over an empty compilation cache,
#                then over that cache (16 layers ran out of a 16 GB chip while their random
#                weights were built op by op; about 7 minutes)
#   restarts     only the 8-layer cold and cached pair of `starts` (about 4 minutes)
#   profile      where a decode step's device time goes, at Llama-3-8B layer widths (8 layers,
#                bfloat16), base traffic and 8 adapters (benchmarks/step_profile.py; about 4 minutes)
#   profile-rows the same at the serving benchmark's batch of 32 rows, base traffic and 16 adapters
#   serving      the serving benchmark's workload (64 Zipf adapters through 8 slots, Poisson arrivals)
#                sent in process to a LoRA-off engine and to the LoRA engine at 8 layers of Llama-3-8B
#                widths (benchmarks/engine_serving.py --large; about 5 minutes)
#   serving-slots  the same at 16 slots, and with the slots sized from memory (adapter_memory_fraction 0.1:
#                about 70 rank-16 slots of these 8 layers), at 100 and 400 req/s (about 5 minutes)
#   serving-trace  the slots sized from memory (adapter_memory_fraction 0.1) at 100 and 400 req/s, each
#                engine's run at 400 traced by the profiler and its device time split by program
#                (benchmarks/serving_trace.py; about 5 minutes)
#   serving-pool the serving trace at 400 req/s (200 requests) with 8 slots and with the slots sized from
#                memory, and a decode step alone at 32 rows of 16 adapters through a 64-slot pool (about 8 minutes)
#   serving-ops  the serving trace at 400 req/s (200 requests) with the slots sized from memory; each
#                engine's summary.json (programs, busiest ops with their HLO text) lands in $OUT (about 5 minutes)
#   serving-prefill-loop  serving-ops with the prompt steps' LoRA through the slot-loop kernels in row tiles
#                (kernels/bgmv/tpu.py): this copy of the tree sets TPU_PREFILL_SLOT_LOOP to 4 (run it last in a
#                call; about 5 minutes)
#   profile-visits  the decode step alone at 32 rows of 16 adapters through 64 slots with the visits
#                kernels (kernels.sgmv.tpu) instead of the default slot loop: this copy of the tree sets
#                TPU_DECODE_SLOT_LOOP to 0, so the engine's program store and compilation cache see new
#                source (run it last in a call; about 2 minutes)
#   load         a checkpoint of 8 layers of Llama-3-8B widths in bfloat16 read onto the chip
#                (benchmarks/checkpoint_load.py; about a minute)
#   smoke        correctness, kv and engine at tiny shapes, interpreted (any machine)
# The image lacks flax, safetensors, tokenizers, jinja2, pydantic and flatbuffers (jax.export's
# serialization): the first four come from the machine's own package index, the rest (and
# llguidance) from the wheels that `bash scripts/device_wheels.sh 3.11` puts in .whl/ (copied
# to the TPU host with the repository).
set -uo pipefail
OUT=${OUT:-./.device_out}
mkdir -p "$OUT"
site=/tmp/site
if [ "${1:-}" != smoke ] && ! PYTHONPATH=${PYTHONPATH:-}:$site python3 -c "import flax, safetensors, tokenizers, jinja2, pydantic, flatbuffers" 2>/dev/null; then
  start=$(date +%s)
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir --no-compile \
    --index-url file:///opt/pypi/simple --target "$site" flax safetensors tokenizers jinja2 fsspec 2>&1 | tail -3
  if ls .whl/*.whl >/dev/null 2>&1; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" .whl/*.whl 2>&1 | tail -3
  fi
  echo "installed in $(( $(date +%s) - start ))s"
fi
# The machine's own JAX stays first; what was installed comes last.
export PYTHONPATH=$PWD:${PYTHONPATH:-}:$site PYTHONUNBUFFERED=1
for mode in "${@:-check}"; do
  case "$mode" in
    smoke)
      python3 benchmarks/device_check.py --cpu-smoke --platform tpu --budget-s 120 --out "$OUT" 2>&1 | tail -12
      python3 -m benchmarks.kv_write --cache-gib 0.05 2>&1 | tail -3
      python3 -m benchmarks.engine_device_check --words 2 --out "$OUT/engine_device_check.json" 2>&1 | tail -4 ;;
    check)
      timeout 250 python3 benchmarks/device_check.py --budget-s 215 --out "$OUT" 2>&1 | tee "$OUT/device_check.log" \
        | grep -v "^  BlockSizes" ;;
    correctness)
      timeout 130 python3 benchmarks/device_check.py --sections env,layouts,correctness,attention --budget-s 115 \
        --out "$OUT/correctness" 2>&1 | tee "$OUT/device_check_correctness.log" | tail -14 ;;
    kv)
      timeout 120 python3 -m benchmarks.kv_write --cache-gib 2 2>&1 | tee "$OUT/kv_write.log" | tail -8 ;;
    engine)
      timeout 120 python3 -m benchmarks.engine_device_check --out "$OUT/engine_device_check.json" 2>&1 \
        | tee "$OUT/engine_device_check.log" | grep -v Warn ;;
    steps)
      for backend in pallas xla; do
        timeout 130 python3 -m benchmarks.multi_lora --quick --large --backend $backend 2>&1 \
          | tee "$OUT/multi_lora_$backend.log" | tail -16
      done ;;
    steps-pallas)
      timeout 300 python3 -m benchmarks.multi_lora --quick --large --backend pallas 2>&1 \
        | tee "$OUT/multi_lora_pallas.log" | tail -16 ;;
    async)
      timeout 280 python3 -m benchmarks.async_decode --large --backend pallas 2>&1 \
        | tee "$OUT/async_decode.log" | grep -v Warn | tail -6 ;;
    long)
      timeout 500 python3 -m benchmarks.long_decode --adapters 8 2>&1 | tee "$OUT/long_decode.log" | grep -v Warn | tail -8 ;;
    starts)
      timeout 450 python3 -m benchmarks.engine_scale --start-only --layers 8 --dtype bfloat16 --widths 8b \
        --depth-widths 1024 2>&1 | tee "$OUT/engine_starts.log" | tail -12 ;;
    restarts)
      timeout 400 python3 -m benchmarks.engine_scale --start-only --layers 8 --dtype bfloat16 --widths 8b \
        --no-depth 2>&1 | tee "$OUT/engine_restarts.log" | tail -8 ;;
    profile)
      for adapters in 0 8; do
        timeout 150 python3 -m benchmarks.step_profile --large --adapters $adapters --out "$OUT/step_profile_$adapters" \
          2>&1 | tee "$OUT/step_profile_$adapters.log" | grep -v Warn | tail -26
      done ;;
    profile-rows)
      for adapters in 0 16; do
        timeout 170 python3 -m benchmarks.step_profile --large --batch 32 --adapters $adapters \
          --out "$OUT/step_profile_32_$adapters" 2>&1 | tee "$OUT/step_profile_32_$adapters.log" | grep -v Warn | tail -26
      done ;;
    serving)
      timeout 500 python3 -m benchmarks.engine_serving --large 2>&1 | tee "$OUT/engine_serving.log" | grep -v Warn \
        | tail -14 ;;
    serving-slots)
      for slots in "--slots 16" "--adapter-memory-fraction 0.1"; do
        name=$(echo $slots | tr -d ' -')
        timeout 260 python3 -m benchmarks.engine_serving --large $slots --rates 100 400 2>&1 \
          | tee "$OUT/engine_serving_$name.log" | grep -v Warn | tail -8
      done ;;
    serving-trace)
      timeout 400 python3 -m benchmarks.engine_serving --large --adapter-memory-fraction 0.1 --rates 100 400 \
        --trace-rate 400 2>&1 | tee "$OUT/engine_serving_trace.log" | grep -v Warn | tail -34 ;;
    serving-pool)
      for slots in "--slots 8" "--adapter-memory-fraction 0.1"; do
        name=$(echo $slots | tr -d ' -')
        timeout 300 python3 -m benchmarks.engine_serving --large $slots --rates 400 --requests 200 --trace-rate 400 \
          --trace-window 1 2 2>&1 | tee "$OUT/engine_serving_trace_$name.log" | grep -v Warn | tail -22
      done
      timeout 120 python3 -m benchmarks.step_profile --large --batch 32 --adapters 16 --slots 64 \
        --out "$OUT/step_profile_32_16_slots64" 2>&1 | tee "$OUT/step_profile_32_16_slots64.log" | grep -v Warn | tail -26 ;;
    serving-ops)
      rm -rf /tmp/serving_trace
      timeout 300 python3 -m benchmarks.engine_serving --large --adapter-memory-fraction 0.1 --rates 400 \
        --requests 200 --trace-rate 400 --trace-window 0.5 1.5 --trace-dir /tmp/serving_trace 2>&1 \
        | tee "$OUT/engine_serving_ops.log" \
        | grep -v Warn | tail -22
      for system in base adapters; do
        cp /tmp/serving_trace/$system/summary.json "$OUT/serving_trace_$system.json"
      done ;;
    serving-prefill-loop)
      sed -i 's/^TPU_PREFILL_SLOT_LOOP = [0-9]*$/TPU_PREFILL_SLOT_LOOP = 4/' kernels/bgmv/tuned_block_sizes.py
      grep -q '^TPU_PREFILL_SLOT_LOOP = 4$' kernels/bgmv/tuned_block_sizes.py || { echo "TPU_PREFILL_SLOT_LOOP not set" >&2; exit 2; }
      OUT=$OUT/prefill_loop bash "$0" serving-ops ;;
    profile-visits)
      sed -i 's/^TPU_DECODE_SLOT_LOOP = [0-9]*$/TPU_DECODE_SLOT_LOOP = 0/' kernels/bgmv/tuned_block_sizes.py
      grep -q '^TPU_DECODE_SLOT_LOOP = 0$' kernels/bgmv/tuned_block_sizes.py || { echo "TPU_DECODE_SLOT_LOOP not set" >&2; exit 2; }
      timeout 170 python3 -m benchmarks.step_profile --large --batch 32 --adapters 16 --slots 64 --top 10 \
        --out "$OUT/step_profile_visits" 2>&1 | tee "$OUT/step_profile_visits.log" | grep -v Warn | head -14 ;;
    load)
      timeout 150 python3 -m benchmarks.checkpoint_load --layers 8 --dtype bfloat16 --widths 8b \
        --profile "$OUT/checkpoint_load_profile.txt" 2>&1 | tee "$OUT/checkpoint_load.log" | tail -5 ;;
    *)
      echo "unknown mode $mode (check, correctness, kv, engine, steps, steps-pallas, async, long, starts, restarts, profile," \
        "profile-rows, serving, serving-slots, serving-trace, serving-pool, serving-ops, serving-prefill-loop, profile-visits, load, smoke)" >&2
      exit 2 ;;
  esac
done
