#!/bin/bash
# The GPU measurements of docs/gpu.md, to run first whenever a GPU is lent: the headline rows in about 6 minutes
# on one H100 or H200, compile included, then the rest while LIMIT lasts.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu_acceptance.sh          # from the repository's root
#   CPU_SMOKE=1 OUT=/tmp/smoke bash benchmarks/gpu_acceptance.sh # every step at a tiny shape on the CPU
#   STEPS="train-loop-eager tcnn" OUT=... bash benchmarks/gpu_acceptance.sh   # a subset, by name
#   GPU_TESTS="tests/gpsa/test_attention.py -k bf16" ...               # other arguments for the gpu-tests step
#
# Steps run in priority order, each under its own time limit (cut to what is left of LIMIT seconds, and
# skipped when less than MIN_STEP is left); a failing step does not stop the others. The headline rows come
# first: the engine against its bare model step (eager, compiled), ConViT-Ti against DeiT-Ti (compiled,
# eager), T-CNN against ResNet-50, the engine end to end on JPEGs, the step's cost counted on the CPU. Each
# step's output goes to $OUT/<step>.log; $OUT/summary.md and $OUT/summary.csv list every step with its exit
# code, seconds and last line (a benchmark's ratio or table row), and summary.md then holds every benchmark's
# tables. The package is installed without dependencies first, so that its console scripts exist (the FSDP
# tests launch them).
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-/tmp/gpu-acceptance}
LIMIT=${LIMIT:-420}     # seconds for all steps together
MIN_STEP=${MIN_STEP:-20} # a step needs at least this many seconds left to start
PYTHON=${PYTHON:-python3}
SMOKE=${CPU_SMOKE:-0}
STEPS=${STEPS:-}
mkdir -p "$OUT" || exit 2
export PYTHONPATH=$ROOT:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH} WANDB_MODE=disabled HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
RAN=() # the steps that ran, in order: their tables go into the summary at the end
SUMMARY=$OUT/summary.md CSV=$OUT/summary.csv
printf '| step | exit | seconds | last line |\n|---|---|---|---|\n' >"$SUMMARY"
echo "step,exit,seconds,last_line" >"$CSV"

left() { echo $((LIMIT - ($(date +%s) - T0))); }

# step NAME SECONDS COMMAND...: runs COMMAND under min(SECONDS, time left), output in $OUT/NAME.log
step() {
  local name=$1 limit=$2 started rc last
  shift 2
  if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt "$MIN_STEP" ]; then
    echo "## $name: skipped, $remaining s left"
    printf '| %s | skipped | 0 | %s s left |\n' "$name" "$remaining" >>"$SUMMARY"
    echo "$name,skipped,0,\"$remaining s left\"" >>"$CSV"
    return 0
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo "## $name (limit $limit s, at $(($(date +%s) - T0)) s)"
  started=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  [ "$rc" -eq 124 ] && echo "(cut at its limit of $limit s)" >>"$OUT/$name.log"
  last=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | tr -d '|"' | cut -c1-160)
  echo "## $name rc=$rc in $(($(date +%s) - started)) s: $last"
  printf '| %s | %s | %s | %s |\n' "$name" "$rc" "$(($(date +%s) - started))" "$last" >>"$SUMMARY"
  RAN+=("$name")
  echo "$name,$rc,$(($(date +%s) - started)),\"$last\"" >>"$CSV"
}

# The installed versions from their metadata (importing timm costs seconds), torch for the device, and the
# positional products the benchmark offers (fused where the GPSA kernel is built): one interpreter, as each
# import of torch costs seconds
VERSIONS=$($PYTHON - <<'EOF'
import sys
from importlib.metadata import version as v

import torch

print("python", sys.version.split()[0], "torch", torch.__version__, "timm", v("timm"), "accelerate", v("accelerate"),
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())
try:
    import triton
    print("triton", triton.__version__)
except Exception:
    print("no triton")
try:
    from convbias.gpsa import POSITIONAL_PRODUCTS
    print("products:", " ".join(p for p in ("kronecker", "dense", "fused") if p in POSITIONAL_PRODUCTS))
except Exception:
    pass
EOF
)
PRODUCTS=$(sed -n 's/^products: //p' <<<"$VERSIONS")
PRODUCTS=${PRODUCTS:-kronecker dense}
JPEGS=$OUT/jpegs
if [ "$SMOKE" = 1 ]; then # every step at a tiny shape on the CPU: checks the script, not the GPU
  DEV="--device cpu --precision fp32"
  TI="$DEV --quick --settings 32px --steps 1 --warmup 1"
  LOOP="--quick --steps 2 --rounds 1"
  TCNN="--quick --steps 1 --warmup 1"
  GPU_TESTS=${GPU_TESTS:-"tests/engine/loop/test_train_loop.py -k preemption"}
  JPEG_ARGS="--classes 2 --per-class 16 --val-per-class 4 --size 64 48"
  ENGINE="--img-size 32 --model-kwargs patch_size=4 --batch-size 8 --workers 1 --mixed-precision no"
  FSDP_TESTS="tests/engine/loop/test_train_loop.py -k workers"
  COST="--models deit_tiny_patch16_224 --img-size 32 --batch-size 2 --augment-batch-size 4"
else
  DEV="--device cuda --precision bf16"
  TI="$DEV --settings 224px --batch-size 256 --steps 12 --warmup 3"
  LOOP="--device cuda --precision bf16 --img-size 224 --patch-size 16 --batch-size 256 --steps 20 --rounds 3 --workers 8 --no-profile"
  TCNN="$DEV --batch-size 128 --steps 10 --warmup 3"
  GPU_TESTS=${GPU_TESTS:-"tests/gpsa/test_attention.py -k cuda"}
  JPEG_ARGS="--classes 10 --per-class 800 --val-per-class 20"
  ENGINE="--batch-size 256 --workers 14 --mixed-precision bf16"
  FSDP_TESTS="tests/engine/loop/test_train_fsdp.py"
  COST=""
fi

{
  echo "# GPU acceptance, $(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  [ -z "$VERSIONS" ] || grep -v '^products: ' <<<"$VERSIONS"
  echo "positional products: $PRODUCTS"
} | tee "$OUT/versions.txt"
if [ "$SMOKE" != 1 ]; then
  $PYTHON -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 ||
    echo "note: the package did not install (see install.log); the FSDP tests need its console scripts"
fi

# The headline rows first (about 6 minutes on one H100 or H200, compile included), then the rest.
step train-loop-eager 55 $PYTHON benchmarks/train_loop.py $LOOP
step train-loop-compiled 95 $PYTHON benchmarks/train_loop.py $LOOP --compile
step ti-compiled-training 85 $PYTHON benchmarks/convit_train_step.py $TI --compile --modes training --models ours deit
step ti-eager-training 35 $PYTHON benchmarks/convit_train_step.py $TI --modes training --models ours deit
step tcnn 45 $PYTHON benchmarks/tcnn_throughput.py $TCNN --variants cnn tcnn
step jpegs 20 $PYTHON benchmarks/make_jpegs.py "$JPEGS" $JPEG_ARGS
step engine-eager 55 $PYTHON train.py -c configs/train/convit/imagenet/convit_tiny.yaml --data-dir "$JPEGS" \
  --epochs 1 --warmup-epochs 0 $ENGINE --output "$OUT/engine-eager"
step step-cost 45 $PYTHON benchmarks/step_cost.py $COST
# Then correctness on the GPU and the other rows
step gpu-tests 60 $PYTHON -m pytest -q -p no:cacheprovider $GPU_TESTS
[ -f tests/gpsa/test_fused_gpsa.py ] && [ "$SMOKE" != 1 ] &&
  step fused-tests 90 $PYTHON -m pytest -q -p no:cacheprovider tests/gpsa/test_fused_gpsa.py
step ti-eager-products 100 $PYTHON benchmarks/convit_train_step.py $TI --modes training inference \
  --positional-product $PRODUCTS --models ours deit
step fsdp 90 $PYTHON -m pytest -q -p no:cacheprovider $FSDP_TESTS
step ti-compiled-products 200 $PYTHON benchmarks/convit_train_step.py $TI --compile --modes training inference \
  --positional-product $PRODUCTS --models ours deit
step s-compiled 120 $PYTHON benchmarks/convit_train_step.py $TI --size small --compile --modes training inference \
  --models ours deit
step train-loop-no-recipe 60 $PYTHON benchmarks/train_loop.py $LOOP --no-recipe

# The engine's own epoch record (images/s, data-wait fraction) beside the benchmarks' lines
if [ -f "$OUT/engine-eager/log.jsonl" ]; then
  $PYTHON -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print('engine end to end:', {k: r[k] for k in ('epoch', 'images_per_sec', 'data_wait_fraction') if k in r})
" "$OUT/engine-eager/log.jsonl" | tee -a "$SUMMARY"
fi
for name in ${RAN[@]+"${RAN[@]}"}; do # each benchmark's markdown tables and ratio lines, as it printed them
  if grep -qE '^\||^ratio |^synchronizing' "$OUT/$name.log"; then
    printf '\n### %s\n\n' "$name" >>"$SUMMARY"
    grep -E '^\||^ratio |^synchronizing|^  [0-9]+ at ' "$OUT/$name.log" >>"$SUMMARY"
  fi
done
echo "total $(($(date +%s) - T0)) s; results in $OUT" | tee -a "$SUMMARY"
