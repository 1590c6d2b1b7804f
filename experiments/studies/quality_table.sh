#!/bin/bash
# Issue 52's quality table (the 1B on the local corpus, 2,000 steps, every precision mode through the host update,
# 3 seeds, the held-out loss after the last step): the (mode, seed) runs in JOBS at once, one per visible GPU, each
# on its own share of the host's cores, as one job of studies/long_run.sh (a batch takes 15-28 minutes on one H200
# of a 16-core host: longer than a device call). Each run writes its own results file, and every run's output goes
# to one log, its lines tagged mode:seed (the device brings back 8 files: at most 5 runs a batch); once the twelve
# are committed, `convergence.py --merge` of them is the table.
#
#   JOBS="float32:0 capacity:0" MEGATRAIN_GIT_COMMIT=<sha> PYTHONPATH=. bash experiments/studies/quality_table.sh start
#   JOBS="q8:0 q8:1 q8:2" PER_GPU=3 ... bash experiments/studies/quality_table.sh start    # three runs on one GPU
#   PYTHONPATH=. bash experiments/studies/quality_table.sh poll
# (made by `local_corpus.py --out build/corpus/corpus.bin --max-mb 80 --train-mb 32`, NOTES has its hash; carry
# build/corpus/corpus.bin, corpus.bin.json and corpus.bin.idx.npy, not the whole folder: its tokenizer.json is not
# read here, and the working tree with the corpus is near the device's 64 MiB a call)
# JOBS: mode:seed pairs, modes from convergence.py's MODES (float32, capacity, q8, m7v5); at most PER_GPU per GPU
# (default 1), spread round-robin. The 1B step is bound by the host update (the GPU works ~0.14 s of it), so several
# runs share one GPU well: where a GPU gets k > 1 runs, each has XLA_PYTHON_CLIENT_MEM_FRACTION=0.9/k of it; every
# run has its own slice of the cores. Measured on one H200 of a 16-core host: three capacity runs to the GPU
# 0.81 s a step each, 1,622-1,644 s for the 2,000 steps (h200_conv_1b_capacity_*_78ccf44.json; the step-time model
# said 0.56 with each run's cores alone, 0.98 with the host's memory shared three ways). Runs sharing a host share
# its memory, which bounds the float32 and capacity updates: plan a session's batch at about 0.83x the model's
# shared figure (16 cores, k runs): float32 one run ~0.43 s, two ~0.66 s; capacity two ~0.55 s; 8-bit two ~0.65,
# three ~0.96; 4-bit two ~0.84. A device session (1,800 s, ~60 s to start) holds ~2,000 steps at up to ~0.8 s.
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
    n=$(echo $JOBS | wc -w); per=${PER_GPU:-1}
    if [ "$gpus" -lt 1 ] || [ "$per" -lt 1 ] || [ "$n" -gt $(( gpus * per )) ]; then
      echo "JOBS has $n runs for $gpus GPUs at PER_GPU=$per: give at most PER_GPU runs per GPU"; exit 2
    fi
    prefix=${PREFIX:-$([ "$gpus" -gt 1 ] && echo "h200x$gpus" || echo h200)}
    # round-robin over the GPUs; each run gets 0.9 of its GPU over the most runs any GPU gets
    most=$(( (n + gpus - 1) / gpus ))
    fraction=$(awk -v k="$most" 'BEGIN { printf "%.3f", 0.9 / k }')
    share=""; [ "$most" -gt 1 ] && share="XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction "
    # the device brings back at most 8 files: a results file per run, one log of them all, the job's and memory logs
    [ "$n" -le 5 ] || { echo "JOBS has $n runs: at most 5 a batch (their results files and 3 logs come back)"; exit 2; }
    cores=$(nproc); slice=$(( cores / n )); i=0; script=""
    [ "$slice" -ge 1 ] || { echo "JOBS has $n runs for $cores cores: give at most one run per core"; exit 2; }
    for job in $JOBS; do
      mode=${job%%:*}; seed=${job##*:}
      first=$(( i * slice )); last=$(( first + slice - 1 ))
      script+="(set -o pipefail; ${share}CUDA_VISIBLE_DEVICES=$(( i % gpus )) taskset -c $first-$last python experiments/studies/convergence.py \
--preset llama3.2-1b --data build/corpus/corpus.bin --rows 4 --seq-len 2048 --steps 2000 --modes $mode --seeds $seed \
--eval-fraction 0.02 --eval-batches 32 --out $W/out/${prefix}_conv_1b_${mode}_${seed}_$TAG.json 2>&1 \
| sed -u 's/^/[$mode:$seed] /' >> $W/out/${prefix}_conv_1b_runs_$TAG.log) & "
      i=$(( i + 1 ))
    done
    # the job's exit status: 1 if any run failed (the runs' log, each line tagged mode:seed, says why)
    export WATCH=${WATCH:-$W/out/${prefix}_conv_1b_runs_$TAG.log}  # each poll prints its last lines
    exec bash "$LONG" start bash -c "${script}fail=0; for p in \$(jobs -p); do wait \$p || fail=1; done; exit \$fail" ;;
  poll) export WATCH=${WATCH:-$(ls "$W"/out/*_conv_1b_runs_*.log 2>/dev/null | head -n 1)}; exec bash "$LONG" poll ;;
  *) echo "usage: JOBS='mode:seed ...' bash $0 start|poll"; exit 2 ;;
esac
