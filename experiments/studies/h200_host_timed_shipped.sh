#!/bin/bash
# One H200 (the 16-core, 125.9 GiB host), one long_run.sh job (two calls, ~8 minutes): shipped configs through
# `megatrain-jax train` with the host update timed at the run's start (249dd3f), each beside its prediction:
# 1. rtx4090_sft_8b under a 24 GB card's and a 120 GiB host's caps (the capped emulation, as issue 53's checks ran
#    it; its two runs before host timing were 11-12% slower than the step-time model), 20 steps, step 8 profiled
#    (each lane's serialized seconds beside the model's), the export off;
# 2. h200_7b_32k as written, 20 steps (the shipped config at this commit).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_host_timed_shipped.sh start   # then, at once:
#   bash experiments/studies/h200_host_timed_shipped.sh poll
# Files back: 2 results, stages.log, job and mem logs. The job's exit status is the number of stages that failed.
W=${W:-/tmp/h200_host_timed_shipped}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.163 MEGATRAIN_HOST_RAM_GIB=120 timeout 420 python experiments/shipped_configs.py \
        --configs rtx4090_sft_8b --steps 20 --timeout 400 --set train.profile_step=8 \
        --out \$O/h200_capped_rtx4090_sft_8b_profiled_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 300 python experiments/shipped_configs.py --configs h200_7b_32k --steps 20 --timeout 280 \
        --out \$O/h200_shipped_configs_${TAG}_h200_7b_32k.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
