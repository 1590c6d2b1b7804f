#!/bin/bash
# Issue 52's long runs on one H200 of nvidia-h200-x4 (503.8 GiB host, 64 cores, 235 GB disk), through
# `megatrain-jax train` with the shipped h200x4_gpt_oss_120b.toml (experiments/shipped_configs.py: the whole
# process's peak, host bytes per parameter, the plan, every step's loss). Each lasts longer than one device call, so
# it runs through studies/long_run.sh: `start` launches it in a process session of its own, each call (`start`,
# then `poll`, issued at once) waits up to 9 minutes and copies what it has written to $OUT. One run fills most of
# a session's device time (the plan's predictions: experiments/studies/NOTES.md).
#
#   RUN=gpt_oss_120b MEGATRAIN_GIT_COMMIT=<sha> PYTHONPATH=. bash experiments/studies/h200x4_100b_training.sh start
#   PYTHONPATH=. bash experiments/studies/h200x4_100b_training.sh poll
# The config's token file (build/corpus/corpus.bin) is made on the device by `start` where it is not there
# (studies/local_corpus.py: the machine's own Python sources and documents, ~1 minute): with the 45 MB file carried,
# the call's tree (~30 MB tracked) is over the device's 64 MiB, and the config says the text is made on the machine.
#
# RUN (one per start):
#   gpt_oss_120b   the config as shipped: 30 steps; train picks m7v5 and the two-pass step itself
#   dense_120b     the same with model.preset=dense-120b (122.9B dense), 10 steps
#   llama3_70b_32k the same with model.preset=llama3-70b, 8-bit moments and bfloat16 gradients in one pass, 30 steps
#                  of 32,768 tokens
#   refusal        GPT-OSS-120B with its Hugging Face export, then with checkpoints: each refused at start (no disk
#                  here holds them), the reason and the bytes in the record; seconds
# SETS: more config overrides for the gpt_oss_120b and dense_120b runs (none needed: train's own pick at 480 GiB is
# m7v5 with the two-pass step), with TAG=<commit>_<what> so that the files say so
set -u
export W=${W:-/tmp/h200x4_100b} WATCH=/tmp/shipped_configs/runs/h200x4_gpt_oss_120b/metrics.jsonl
export PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} NCCL_NVLS_ENABLE=0
export MEGATRAIN_HOST_RAM_GIB=${MEGATRAIN_HOST_RAM_GIB:-480}
RUN=${RUN:-gpt_oss_120b}
TAG=${TAG:-$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)}
TAG=${TAG:-$(date +%F)}
LONG="$(dirname "$0")/long_run.sh"
SC=(python experiments/shipped_configs.py --configs h200x4_gpt_oss_120b --timeout 7200)

case ${1:-poll} in
  start)
    case $RUN in
      gpt_oss_120b) cmd=("${SC[@]}" --steps 30 --out "$W/out/h200x4_gpt_oss_120b_$TAG.json") ;;
      dense_120b) cmd=("${SC[@]}" --steps 10 --set model.preset=dense-120b --out "$W/out/h200x4_dense_120b_$TAG.json") ;;
      llama3_70b_32k) cmd=("${SC[@]}" --steps 30 --set model.preset=llama3-70b --set engine.moment_dtype=q8
                           --set engine.host_grad_dtype=bfloat16 --out "$W/out/h200x4_llama3_70b_32k_$TAG.json") ;;
      refusal) cmd=(bash -c "${SC[*]} --steps 30 --export --out $W/out/h200x4_gpt_oss_120b_export_refused_$TAG.json;
                    ${SC[*]} --steps 30 --set train.checkpoint_every=10 \
                    --out $W/out/h200x4_gpt_oss_120b_checkpoint_refused_$TAG.json") ;;
      *) echo "unknown RUN=$RUN (gpt_oss_120b, dense_120b, llama3_70b_32k, refusal)"; exit 2 ;;
    esac
    if [ ! -f build/corpus/corpus.bin ]; then
      python experiments/studies/local_corpus.py --out build/corpus/corpus.bin --max-mb 80 --train-mb 32 | tail -n 1
    fi
    if [ -n "${SETS:-}" ]; then
      case $RUN in gpt_oss_120b|dense_120b) ;; *) echo "SETS applies to gpt_oss_120b and dense_120b"; exit 2 ;; esac
      for s in $SETS; do cmd+=(--set "$s"); done
    fi
    exec bash "$LONG" start "${cmd[@]}" ;;
  poll) exec bash "$LONG" poll ;;
  *) echo "usage: RUN=... bash $0 start|poll"; exit 2 ;;
esac
