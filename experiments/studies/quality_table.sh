#!/bin/bash
# Issue 52's quality table (the 1B on the local corpus, 2,000 steps, every precision mode through the host update,
# 3 seeds, the held-out loss after the last step): the (mode, seed) runs in JOBS at once, one per visible GPU, each
# on its own share of the host's cores, as one job of studies/long_run.sh (a run takes 12-17 minutes on one H200
# of a 16-core host: longer than a device call). Each run writes its own results file; once the twelve are
# committed, `convergence.py --merge` of them is the table.
#
#   JOBS="float32:0 capacity:0" MEGATRAIN_GIT_COMMIT=<sha> PYTHONPATH=. bash experiments/studies/quality_table.sh start
#   PYTHONPATH=. bash experiments/studies/quality_table.sh poll
# (carry build/corpus: `local_corpus.py --out build/corpus/corpus.bin --max-mb 80 --train-mb 32`, NOTES has its hash)
# JOBS: mode:seed pairs, modes from convergence.py's MODES (float32, capacity, q8, q4); at most one per GPU.
# PREFIX names the machine in the files' names (default: h200, or h200xN with N GPUs).
set -u
export W=${W:-/tmp/quality_table} PYTHONPATH=${PYTHONPATH:-.}
JOBS=${JOBS:-float32:0}
TAG=${TAG:-$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)}
TAG=${TAG:-$(date +%F)}
LONG="$(dirname "$0")/long_run.sh"

case ${1:-poll} in
  start)
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    n=$(echo $JOBS | wc -w)
    if [ "$gpus" -lt 1 ] || [ "$n" -gt "$gpus" ]; then
      echo "JOBS has $n runs for $gpus GPUs: give at most one run per GPU"; exit 2
    fi
    prefix=${PREFIX:-$([ "$gpus" -gt 1 ] && echo "h200x$gpus" || echo h200)}
    cores=$(nproc); share=$(( cores / n )); i=0; script=""
    for job in $JOBS; do
      mode=${job%%:*}; seed=${job##*:}
      first=$(( i * share )); last=$(( first + share - 1 ))
      script+="CUDA_VISIBLE_DEVICES=$i taskset -c $first-$last python experiments/studies/convergence.py \
--preset llama3.2-1b --data build/corpus/corpus.bin --rows 4 --seq-len 2048 --steps 2000 --modes $mode --seeds $seed \
--eval-fraction 0.02 --eval-batches 32 --out $W/out/${prefix}_conv_1b_${mode}_${seed}_$TAG.json \
> $W/out/${prefix}_conv_1b_${mode}_${seed}_$TAG.log 2>&1 & "
      i=$(( i + 1 ))
    done
    # the job's exit status: 1 if any run failed (each run's log says why)
    exec bash "$LONG" start bash -c "${script}fail=0; for p in \$(jobs -p); do wait \$p || fail=1; done; exit \$fail" ;;
  poll) exec bash "$LONG" poll ;;
  *) echo "usage: JOBS='mode:seed ...' bash $0 start|poll"; exit 2 ;;
esac
