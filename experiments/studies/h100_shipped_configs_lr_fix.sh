#!/bin/bash
# H100 box: shipped configs as written after the learning-rate fix (20 steps each).
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}  # results names carry the commit they ran at
set -u
for c in h100_3p5b_32k h100_7b_32k; do
  PYTHONPATH=. timeout 280 python experiments/shipped_configs.py --configs $c --steps 20 --timeout 260 \
    --out $OUT/h100_shipped_configs_${TAG}_$c.json 2>&1 | tail -c 600
  echo
done
