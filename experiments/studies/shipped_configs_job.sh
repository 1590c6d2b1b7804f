#!/bin/bash
# One GPU (one H200, or one H200 of nvidia-h200-x2: PREFIX names the files, h200 or h200x2), one long_run.sh job
# (two calls, ~9 minutes): the shipped one-H200 configs through `megatrain-jax train` as written, after an engine
# change that every config goes through:
# 1. h200_7b_32k, 20 steps (shipped_configs.py; export off);
# 2. h200_sft_8b, 12 steps, with its Hugging Face export on and the process's memory logged through the export,
#    then the export loaded back (h200_sft_8b_end_of_run.sh; its files under sft/).
#
#   PREFIX=h200 MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/shipped_configs_job.sh start   # then:
#   PREFIX=h200 bash experiments/studies/shipped_configs_job.sh poll
P=${PREFIX:?set PREFIX to h200 or h200x2}
W=${W:-/tmp/shipped_configs_job}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 290 python experiments/shipped_configs.py --configs h200_7b_32k --steps 20 --timeout 270 \
        --out \$O/${P}_shipped_configs_${TAG}_h200_7b_32k.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      mkdir -p \$O/sft
      OUT=\$O/sft TAG=$TAG timeout 580 bash $HERE/h200_sft_8b_end_of_run.sh >> \$O/stages.log 2>&1 \
        || fail=\$((fail + 1))"
