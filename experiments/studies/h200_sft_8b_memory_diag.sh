#!/bin/bash
# One H200: the shipped h200_sft_8b as written, with the host's memory logged every 2 s, then the run folder and the
# kernel's log: why the run was killed at its final save (writes $OUT/h200_shipped_configs_${TAG}_h200_sft_8b_c.json).
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}  # results names carry the commit they ran at
set -u
export PYTHONPATH=.
df -h / /tmp | sed 's/^/df: /'; mount | grep -E " on (/|/tmp) " | sed 's/^/mount: /'; free -g | sed 's/^/free: /'
R=/tmp/shipped_configs/runs/h200_sft_8b
( while true; do echo "t=$(date +%s) $(grep -E '^(MemAvailable|Shmem|Dirty|Writeback|Cached):' /proc/meminfo | tr -s ' ' | tr '\n' ' ') ckpt=$(du -sm $R/checkpoints 2>/dev/null | cut -f1)MB"; sleep 2; done ) > $OUT/mem.log 2>&1 &
S=$!
timeout 520 python experiments/shipped_configs.py --configs h200_sft_8b --steps 20 --timeout 500 --out $OUT/h200_shipped_configs_${TAG}_h200_sft_8b_c.json 2>&1 | tail -n 2 | cut -c1-200
kill $S
ls -la $R $R/checkpoints 2>&1 | head -20
dmesg 2>&1 | tail -8
tail -25 $OUT/mem.log
