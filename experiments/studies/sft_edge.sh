#!/usr/bin/env bash
# Issue 31: the shipped 8B SFT example at the GPU memory edge, through the command line as a user runs it.
# A random Llama-3.1-8B-shaped HF folder and generated chat data (sft_run.py's stages), then
# `megatrain-jax train --config experiments/configs/h100_sft_8b.toml` with JAX's default memory fraction,
# then again with XLA_PYTHON_CLIENT_MEM_FRACTION=$FRACTION. Logs and metrics go to $OUT.
#   bash experiments/studies/sft_edge.sh   (on the H100 box; OUT=... STEPS=... FRACTION=...)
set -u
OUT=${OUT:-/tmp/sft_edge_out}; STEPS=${STEPS:-12}; FRACTION=${FRACTION:-0.95}; W=${WORK:-/tmp/sft8b}
mkdir -p "$OUT" "$W"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=0
t0=$(date +%s)
python experiments/studies/sft_run.py --work "$W" --preset llama3.1-8b --examples 4000 --stage data > "$OUT/make.log" 2>&1
python experiments/studies/sft_run.py --work "$W" --preset llama3.1-8b --stage checkpoint >> "$OUT/make.log" 2>&1
echo "made checkpoint and data: $(( $(date +%s) - t0 )) s, rc=$?"
train() {  # name, then extra environment
  local name=$1; shift
  rm -rf "/tmp/run_$name"
  env "$@" timeout "${LIMIT:-240}" python -m megatrain_jax train --config experiments/configs/h100_sft_8b.toml \
    model.hf_checkpoint="$W/checkpoint" data.path="$W/chat.jsonl" train.steps="$STEPS" train.eval_every=0 \
    train.log_every=1 train.run_dir="/tmp/run_$name" train.export_hf=none > "$OUT/train_$name.log" 2>&1
  local rc=$?; tail -c 15000000 "$OUT/train_$name.log" > "$OUT/t" && mv "$OUT/t" "$OUT/train_$name.log"
  echo "train $name: rc=$rc after $(( $(date +%s) - t0 )) s"
  cp "/tmp/run_$name/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null
  grep -E "megatrain_jax:|planned memory|error|out of device memory|ran out|Allocator|RESOURCE|step +[0-9]+ " \
    "$OUT/train_$name.log" | cut -c1-400 | tail -25
}
train default
LIMIT=${LIMIT2:-240} train fraction XLA_PYTHON_CLIENT_MEM_FRACTION="$FRACTION"
