#!/bin/bash
# One H200 (the 16-core host), one call (~8-9 minutes): the start's host timing once a second after a process has
# taken, touched and freed 64 GiB (host_timing_after_file_io.py --phases freed: file writes did not slow it,
# h200_host_timing_after_file_io_bd3dc11.json), then the shipped h200_sft_8b as written with its export
# (h200_sft_8b_end_of_run.sh), whose start at 2e2af23 timed 2.01 G params/s right after its script had made the
# 8B checkpoint in another process.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_host_timing_freed_sft.sh
set -u
export PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=0
TAG=$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)
OUT=${OUT:?set OUT to the folder the results go to}
fail=0
timeout 110 python experiments/studies/host_timing_after_file_io.py --phases freed --free-gib 64 \
  --out "$OUT/h200_host_timing_after_freeing_$TAG.json" > "$OUT/h200_host_timing_after_freeing_$TAG.log" 2>&1 \
  || fail=$((fail + 1))
tail -n 20 "$OUT/h200_host_timing_after_freeing_$TAG.log"
rm -rf /tmp/shipped_configs/runs/h200_sft_8b  # a warm machine keeps an earlier call's run folder
TAG=$TAG bash experiments/studies/h200_sft_8b_end_of_run.sh || fail=$((fail + 1))
exit $fail
