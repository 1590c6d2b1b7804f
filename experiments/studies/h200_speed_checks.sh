#!/bin/bash
# One H200 (125.9 GiB host), one device call (about 9 minutes): the checks issue 51's next step needs, each
# writing its own results file under $OUT (TAG: the commit, for the file names; MEGATRAIN_GIT_COMMIT: the full one).
# 1. h200_7b_32k through `megatrain-jax train` with resident_layers and kept_layers "auto": the plan's fastest
#    layout, re-picked with the rates where XLA's figures refuse the estimate's (ef91ed7), predicted vs measured;
# 2. the machine's rates for the step-time model (measure_speeds.py), and the host's STREAM copy and triad beside
#    the AdamW kernel (host_update_profile.py);
# 3. plain all-GPU training of 3.5B at 8K, each remat policy (plain_gpu.py: the bar where the model fits);
# 4. SlideFormer at 3.5B and 8K tokens, with the host's MemAvailable and its resident memory logged every second
#    (its 32K run was killed before its first step: h200_slideformer_3p5b_32k_5ff9aaf.json).
# Needs carry: .peers/slideformer and .whl/slideformer (scripts/fetch_slideformer.sh, scripts/build_peer_wheels.sh).
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}
set -u
export PYTHONPATH=.
timeout 200 python experiments/shipped_configs.py --configs h200_7b_32k --steps 8 --timeout 190 \
  --set engine.resident_layers=auto --set engine.kept_layers=auto \
  --out $OUT/h200_7b_32k_fastest_${TAG}.json 2>&1 | tail -n 1 | cut -c1-400
timeout 60 python experiments/measure_speeds.py --out $OUT/h200_measure_speeds_${TAG}.json 2>&1 | tail -n 1
timeout 60 python experiments/studies/host_update_profile.py --params 256 --reps 3 --threads 16 \
  --out $OUT/h200_host_update_profile_${TAG}.json 2>&1 | tail -n 1
timeout 120 python experiments/plain_gpu.py --configs 3p5b_8k --policies nothing,dots --warmup 2 --steps 4 \
  --out $OUT/h200_plain_gpu_3p5b_8k_${TAG}.json 2>&1 | tail -n 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_slideformer \
  .whl/slideformer/*.whl 2>&1 | tail -n 2
( while true; do
    pid=$(pgrep -f "slideformer_bench.py" | head -1)
    rss=$( [ -n "$pid" ] && grep -E '^(VmRSS|VmHWM|RssAnon|RssShmem):' /proc/$pid/status 2>/dev/null | tr -s ' ' | tr '\n' ' ')
    echo "t=$(date +%s) $(grep -E '^(MemAvailable):' /proc/meminfo | tr -s ' ' | tr '\n' ' ') $rss"
    sleep 1
  done ) > $OUT/slideformer_mem.log 2>&1 &
S=$!
timeout 170 python3 experiments/peers/slideformer_bench.py --layers 16 --rows 4 \
  --out $OUT/h200_slideformer_3p5b_8k_${TAG}.json 2>&1 | tail -n 5
kill $S
dmesg 2>&1 | tail -n 3
echo "least MemAvailable (kB): $(grep -o 'MemAvailable: [0-9]*' $OUT/slideformer_mem.log | awk '{print $2}' | sort -n | head -1)"
echo "peak VmHWM (kB): $(grep -o 'VmHWM: [0-9]*' $OUT/slideformer_mem.log | awk '{print $2}' | sort -n | tail -1)"
