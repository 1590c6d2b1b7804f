#!/bin/bash
# One H200 (the 16-core host), one call (~6 minutes): whether the start's host timing reads slow after large file
# writes (host_timing_after_file_io.py: 24 GiB written, timed once a second while it is written back, after a
# sync, after the pages are read back, and the start's timing with its retake after a second write), then the
# shipped DPO config through `megatrain-jax train` (dpo_generated.py), whose start at bd2e5c4 timed full precision
# at 2.04 G params/s and predicted its step 20.7% long.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_host_timing_file_io_dpo.sh
# Writes $OUT/h200_host_timing_after_file_io_<commit>.json, $OUT/h200_dpo_8b_generated_<commit>.json and a log.
set -u
export PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=0
TAG=$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)
OUT=${OUT:?set OUT to the folder the results go to}
LOG="$OUT/h200_host_timing_file_io_dpo_$TAG.log"
fail=0
rm -rf runs/h200_dpo_8b_generated  # a warm machine keeps an earlier call's run folder
timeout 200 python experiments/studies/host_timing_after_file_io.py --gib 24 --dir /tmp \
  --out "$OUT/h200_host_timing_after_file_io_$TAG.json" >> "$LOG" 2>&1 || fail=$((fail + 1))
timeout 330 python experiments/studies/dpo_generated.py --timeout 310 \
  --out "$OUT/h200_dpo_8b_generated_$TAG.json" >> "$LOG" 2>&1 || fail=$((fail + 1))
tail -n 25 "$LOG"
exit $fail
