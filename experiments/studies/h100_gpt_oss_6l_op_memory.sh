#!/bin/bash
# H100 box, one call: GPT-OSS's six layers with the sliding layers on cuDNN (layers.sink_rescaled,
# dispatched by attend), then where Gemma-3-12B's allocator waste comes from (8 layers: the run's batch, one
# micro-batch of half of it, and Llama-3.1-8B at the run's batch).
set -u
export PYTHONPATH=.
mkdir -p $OUT/run
timeout 330 python experiments/shipped_configs.py --configs h100_7b_32k --set model.preset=gpt-oss-20b \
  --set model.layers=6 --set engine.master_dtype=bfloat16 --set engine.resident_layers=0 \
  --set engine.resident_io=false --set optimizer.warmup_steps=2 --steps 8 --timeout 300 \
  --out $OUT/h100_gpt_oss_20b_6l_v3_cli.json 2>&1 | tail -n 6
find /tmp/shipped_configs -maxdepth 4 -type f \( -name "*.json*" -o -name "*.toml" \) -size -20M -exec cp {} $OUT/run/ \;
L="--seq-len 2048 --layers 8 --master-dtype bfloat16 --moment-dtype q8 --host-grad-dtype bfloat16 --async-first 1 --live-arrays"
for spec in "gemma3-12b 16 2" "gemma3-12b 8 1" "llama3.1-8b 16 2"; do
  set -- $spec
  timeout 120 python experiments/studies/op_memory.py --preset $1 --rows $2 --micro-batches $3 $L \
    --out $OUT/h100_op_memory_${1}_l8_r${2}_mb${3}.json > $OUT/op_${1}_${2}_${3}.log 2>&1
  echo "$spec rc=$?"; tail -n 3 $OUT/op_${1}_${2}_${3}.log
done
