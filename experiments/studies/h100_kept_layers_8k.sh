#!/bin/bash
# H100 box: 3.5B at 8K tokens with and without every block keeping its matrix products (kept_layers).
set -u
for c in 3p5b_8k 3p5b_8k_k16; do
  PYTHONPATH=. timeout 280 python experiments/bench.py --configs $c --steps 10 --append --name h100_kept_layers_8k \
    --out $OUT/h100_kept_layers_8k.json 2>&1 | grep -v "^W\|Warning" | tail -n 1
done
