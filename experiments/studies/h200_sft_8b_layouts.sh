#!/bin/bash
# One H200 (125.9 GiB host), one long_run.sh job (two calls, ~10 minutes): the shipped h200_sft_8b through
# `megatrain-jax train`, 12 steps, its step 6 profiled (each lane's serialized seconds beside the plan's), first
# as written (12 resident blocks, one block fetched ahead), then at the layout the plan picks for it
# (`resident_layers=auto kept_layers=auto prefetch_depth=2`) with its Hugging Face export on, so that the whole
# process's peak through the export says whether that layout still fits the host at the run's end.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_sft_8b_layouts.sh start   # then, at once after each call:
#   bash experiments/studies/h200_sft_8b_layouts.sh poll
W=${W:-/tmp/h200_sft_8b_layouts}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 330 python experiments/shipped_configs.py --configs h200_sft_8b --steps 12 --timeout 310 \
        --set train.profile_step=6 \
        --out \$O/h200_shipped_configs_${TAG}_h200_sft_8b_profiled.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 420 python experiments/shipped_configs.py --configs h200_sft_8b --steps 12 --timeout 400 --export \
        --set train.profile_step=6 --set engine.resident_layers=auto --set engine.kept_layers=auto \
        --set engine.prefetch_depth=2 \
        --out \$O/h200_shipped_configs_${TAG}_h200_sft_8b_plan_layout.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
