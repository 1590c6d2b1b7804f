#!/bin/bash
# Issue 52's long runs on one H200 of nvidia-h200-x4 (503.8 GiB host, 64 cores, 235 GB disk), through
# `megatrain-jax train` with the shipped h200x4_gpt_oss_120b.toml (experiments/shipped_configs.py: the whole
# process's peak, host bytes per parameter, the plan, every step's loss). A run lasts longer than one device call
# (10 minutes): `start` launches it in a process session of its own (setsid), which the machine keeps running
# between calls while it stays warm; each call (`start`, then `poll`) waits up to POLL_S seconds (default 540),
# prints the run's last steps and the host's free memory, and copies what the run has written to $OUT. Issue the
# next `poll` at once: the machine goes back after 30 s idle, and the run with it. One run fills most of a
# session's device time (the plan's predictions: experiments/studies/NOTES.md).
#
#   RUN=gpt_oss_120b MEGATRAIN_GIT_COMMIT=<sha> PYTHONPATH=. bash experiments/studies/h200x4_100b_training.sh start
#   PYTHONPATH=. bash experiments/studies/h200x4_100b_training.sh poll
# (carry build/corpus: the config's token file, from studies/local_corpus.py)
#
# RUN (one per start):
#   gpt_oss_120b   the config as shipped: 30 steps; train picks 4-bit moments and the two-pass step itself
#   dense_120b     the same with model.preset=dense-120b (122.9B dense), 10 steps
#   llama3_70b_32k the same with model.preset=llama3-70b, 8-bit moments and bfloat16 gradients in one pass, 30 steps
#                  of 32,768 tokens
#   refusal        GPT-OSS-120B with its Hugging Face export, then with checkpoints: each refused at start (no disk
#                  here holds them), the reason and the bytes in the record; seconds
set -u
W=${W:-/tmp/h200x4_100b}
RUN=${RUN:-gpt_oss_120b}
TAG=${TAG:-$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)}
TAG=${TAG:-$(date +%F)}
export PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} NCCL_NVLS_ENABLE=0
export MEGATRAIN_HOST_RAM_GIB=${MEGATRAIN_HOST_RAM_GIB:-480}
SC="python experiments/shipped_configs.py --configs h200x4_gpt_oss_120b --timeout 7200"

run() {
  case $RUN in
    gpt_oss_120b) $SC --steps 30 --out $W/h200x4_gpt_oss_120b_$TAG.json ;;
    dense_120b) $SC --steps 10 --set model.preset=dense-120b --out $W/h200x4_dense_120b_$TAG.json ;;
    llama3_70b_32k) $SC --steps 30 --set model.preset=llama3-70b --set engine.moment_dtype=q8 \
                      --set engine.host_grad_dtype=bfloat16 --out $W/h200x4_llama3_70b_32k_$TAG.json ;;
    refusal) $SC --steps 30 --export --out $W/h200x4_gpt_oss_120b_export_refused_$TAG.json
             $SC --steps 30 --set train.checkpoint_every=10 --out $W/h200x4_gpt_oss_120b_checkpoint_refused_$TAG.json ;;
    *) echo "unknown RUN=$RUN"; return 2 ;;
  esac
}

sample() {
  while true; do echo "t=$(date +%s) $(grep -E '^(MemAvailable|Dirty):' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"
    sleep 5; done
}

case ${1:-poll} in
  start)
    mkdir -p $W
    if [ -f $W/run.pid ] && kill -0 "$(cat $W/run.pid)" 2>/dev/null; then
      echo "a run is in flight ($(cat $W/run.name)): polling it"
    else
      rm -f $W/run.done /tmp/shipped_configs/runs/h200x4_gpt_oss_120b/metrics.jsonl  # no earlier run's steps
      echo $RUN > $W/run.name
      # the run and a sampler of the host's free memory, in a session of their own (they outlive this call)
      setsid nohup bash -c "$(declare -f run sample); RUN=$RUN W=$W TAG=$TAG SC='$SC'
        sample > $W/mem.log 2>&1 & S=\$!; run; rc=\$?; kill \$S; echo \$rc > $W/run.done" \
        > $W/run.log 2>&1 < /dev/null &
      echo $! > $W/run.pid
      echo "started $RUN ($TAG), pid $(cat $W/run.pid)"
    fi
    exec bash "$0" poll ;;
  poll)
    end=$(( $(date +%s) + ${POLL_S:-540} ))
    while [ ! -f $W/run.done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    metrics=$(ls -t /tmp/shipped_configs/runs/*/metrics.jsonl 2>/dev/null | head -1)
    [ -n "$metrics" ] && tail -n 3 "$metrics" | cut -c1-300
    tail -n 1 $W/mem.log 2>/dev/null
    tail -n 4 $W/run.log 2>/dev/null | cut -c1-400
    mkdir -p "${OUT:-/tmp/out}"
    cp $W/*.json $W/run.log $W/mem.log "${OUT:-/tmp/out}/" 2>/dev/null
    [ -n "$metrics" ] && cp "$metrics" "${OUT:-/tmp/out}/$(cat $W/run.name 2>/dev/null)_metrics.jsonl"
    if [ -f $W/run.done ]; then
      echo "done: $(cat $W/run.name) exit $(cat $W/run.done)"
    else
      echo "still running: poll again now (the machine goes back after 30 s idle)"
    fi ;;
  *) echo "usage: RUN=... bash $0 start|poll"; exit 2 ;;
esac
