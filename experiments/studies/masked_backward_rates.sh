#!/bin/bash
# One H200, one call (~6 minutes): how much faster a block's backward runs with part of each row out of the loss
# (its gradients zeros there), against the share out of it: layer_compute.py's our half (untraced) on whole rows at
# the llama3.1-8b shape (4 x 4,096 tokens) with 2,048 and 1,024 tokens a row in the loss, and at Llama-2-13B's
# shape (16 x 2,048) with all and with 227 (11%, as h200_sft_8b's generated chats) in it. With
# h200_block_kernels_8b_loss{4096,450}_c75ab97.json, the points the step-time model's rate is fitted to.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/masked_backward_rates.sh
set -u
export PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
TAG=$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)
O=${OUT:-/tmp/out}; mkdir -p "$O"
fail=0
for n in 2048 1024; do
  timeout 150 python experiments/studies/layer_compute.py --halves ours --preset llama3.1-8b --rows 4 --seq 4096 \
    --loss-tokens $n --out "$O/h200_block_kernels_8b_loss${n}_$TAG.json" || fail=$((fail + 1))
done
for n in 2048 227; do
  timeout 150 python experiments/studies/layer_compute.py --halves ours --preset llama2-13b --rows 16 --seq 2048 \
    --loss-tokens $n --out "$O/h200_block_kernels_13b_loss${n}_$TAG.json" || fail=$((fail + 1))
done
exit $fail
