#!/bin/bash
# Shipped configs as written (20 steps each), one results file per config.
#   bash experiments/studies/shipped_configs_as_written.sh h100 demo_tiny,h100_7b_32k,h100_3p5b_32k    # H100 box
#   bash experiments/studies/shipped_configs_as_written.sh h200 h200_7b_32k,h200_sft_8b                # one H200
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}  # results names carry the commit they ran at
set -u
for c in ${2//,/ }; do
  PYTHONPATH=. timeout 290 python experiments/shipped_configs.py --configs $c --steps 20 --timeout 270 \
    --out $OUT/$1_shipped_configs_${TAG}_$c.json 2>&1 | tail -c 500
  echo
done
