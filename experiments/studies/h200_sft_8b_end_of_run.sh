#!/bin/bash
# One H200 (125.9 GiB host): the shipped h200_sft_8b as written *with its Hugging Face export* (shipped_configs.py
# turns the export off unless --set turns it back on), 12 steps, with the train process's resident memory (VmRSS,
# VmHWM: its peak) and the host's MemAvailable logged every second through training, the end-of-run sync and the
# export; then the export folder and the kernel's log. Checks the 2026-11-28 prediction in studies/NOTES.md
# (writes $OUT/h200_shipped_configs_${TAG}_h200_sft_8b_${NAME}.json, NAME "end" unless set, its export's load check
# and $OUT/mem.log). SETS: more `--set` overrides, space-separated (e.g. "engine.resident_layers=auto").
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}
NAME=${NAME:-end}
SETS=${SETS:-}
set -u
export PYTHONPATH=.
free -g | sed 's/^/free: /'
W=/tmp/shipped_configs
R=$W/runs/h200_sft_8b
( while true; do
    pid=$(pgrep -f "megatrain_jax train --config" | head -1)
    rss=$( [ -n "$pid" ] && grep -E '^(VmRSS|VmHWM|RssAnon|RssShmem):' /proc/$pid/status 2>/dev/null | tr -s ' ' | tr '\n' ' ')
    echo "t=$(date +%s) $(grep -E '^(MemAvailable|Shmem|Dirty):' /proc/meminfo | tr -s ' ' | tr '\n' ' ') $rss hf=$(du -sm $R/hf $W/runs/.hf.partial-* 2>/dev/null | cut -f1 | paste -sd+)MB"
    sleep 1
  done ) > $OUT/mem.log 2>&1 &
S=$!
timeout 400 python experiments/shipped_configs.py --configs h200_sft_8b --steps 12 --timeout 380 \
  --set train.export_hf=$R/hf $(for s in $SETS; do printf -- '--set %s ' "$s"; done) \
  --out $OUT/h200_shipped_configs_${TAG}_h200_sft_8b_${NAME}.json 2>&1 | tail -n 2 | cut -c1-300
kill $S
ls -la $R/hf 2>&1 | head -12
timeout 150 python experiments/studies/hf_export_loads.py $R/hf --out $OUT/h200_shipped_configs_${TAG}_h200_sft_8b_${NAME}_export_loads.json 2>&1 | tail -n 1
dmesg 2>&1 | tail -4
echo "peak VmHWM (kB): $(grep -o 'VmHWM: [0-9]*' $OUT/mem.log | awk '{print $2}' | sort -n | tail -1)"
echo "least MemAvailable (kB): $(grep -o 'MemAvailable: [0-9]*' $OUT/mem.log | awk '{print $2}' | sort -n | head -1)"
tail -30 $OUT/mem.log
