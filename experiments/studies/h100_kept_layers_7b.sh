#!/bin/bash
# H100 box: 7B at 32K tokens, the current layout (17 of 32 blocks resident) against layouts with fewer
# resident blocks and the last ones keeping their matrix products (kept_layers). Each configuration in its own process.
#   bash experiments/studies/h100_kept_layers_7b.sh 7b_32k,7b_32k_r8_k11,7b_32k_mb1_r8_k10
set -u
for c in ${1//,/ }; do
  PYTHONPATH=. timeout 200 python experiments/bench.py --configs $c --steps 6 --warmup 2 --timeline-steps 2 --append \
    --name h100_kept_layers_7b --out $OUT/h100_kept_layers_7b${2:-}.json 2>&1 | grep -v "^W\|Warning" | tail -n 1
done
