#!/bin/bash
# H100 box: the shipped h100_7b_32k as written, 8 steps, with XLA's pinned pool capped by hand at
# 32 GiB (what its 30.6 GiB of pinned arrays round to) and at 35 GiB: is the pool's growth past the arrays needed?
set -u
for cap in 32 35; do
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=$cap PYTHONPATH=. timeout 250 python experiments/shipped_configs.py \
    --configs h100_7b_32k --steps 8 --timeout 230 --out $OUT/h100_pool_cap_${cap}_h100_7b_32k.json 2>&1 | tail -c 300
  echo
done
