#!/bin/bash
# H100 box, one call: where the 1B 8-bit step goes (issue 35), and the sliding sink layers on cuDNN
# (issue 34's follow-up). Each bench config in its own process, as `train` runs one model per process.
set -u
export PYTHONPATH=.
for c in 1b_8k_q8 1b_8k_capacity 1b_8k_f32; do
  timeout 150 python experiments/bench.py --configs $c --warmup 3 --steps 8 --timeline-steps 2 \
    --out $OUT/h100_$c.json > $OUT/$c.log 2>&1; echo "$c rc=$?"; tail -3 $OUT/$c.log
done
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_attention.py -k rescaled 2>&1 | tail -5
timeout 150 python experiments/studies/gpt_oss_bench.py --out $OUT/h100_gpt_oss_parts_v2.json 2>&1 | tail -15
