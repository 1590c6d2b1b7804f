#!/bin/bash
# One H200 (the 16-core host), one call (~6 minutes): the capped rtx4090_sft_8b (a 24 GB card's and a 120 GiB
# host's caps) through `megatrain-jax train` twice in a row, a process each, 20 steps, step 8 profiled, the export
# off: whether `train`'s −10% and −11% on two loans (d93059a, a6e8da5) are each process's timing of the host at its
# start (±7% from one process to the next, experiments/studies/NOTES.md, 2026-12-01), as bench.py's −1.5% to −3.6%
# on three quiet loans suggest: two processes on one loan, one prediction each.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_capped_8b_train_twice.sh
# Writes $OUT/h200_capped_rtx4090_sft_8b_profiled_{a,b}_<commit>.json and their log.
set -u
export PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.163 MEGATRAIN_HOST_RAM_GIB=120
TAG=$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)
OUT=${OUT:?set OUT to the folder the results go to}
fail=0
for k in a b; do
  timeout 270 python experiments/shipped_configs.py --configs rtx4090_sft_8b --steps 20 --timeout 250 \
    --set train.profile_step=8 --out "$OUT/h200_capped_rtx4090_sft_8b_profiled_${k}_$TAG.json" \
    >> "$OUT/h200_capped_8b_train_twice_$TAG.log" 2>&1 || fail=$((fail + 1))
done
exit $fail
