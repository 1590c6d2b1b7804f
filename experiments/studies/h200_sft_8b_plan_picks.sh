#!/bin/bash
# One H200 (125.9 GiB host), one long_run.sh job (two calls, ~14 minutes): the shipped h200_sft_8b with its layout
# picked by the plan (`resident_layers` and `kept_layers` "auto", two blocks fetched ahead) through
# `megatrain-jax train`, as written, with its Hugging Face export, the process's memory logged through it and the
# export loaded back (h200_sft_8b_end_of_run.sh, its files under sft/); then, 12 steps each with step 6 profiled
# and no export, on the same host: the plan's pick with one block fetched ahead, and the layout measured before
# (27 blocks resident, none keeping products; h200_shipped_configs_773ebca_h200_sft_8b_plan_layout.json); then
# `megatrain-jax plan --exact` of the config as written (plan_exact.txt: the picks with XLA's figures, in full).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_sft_8b_plan_picks.sh start   # then, at once after each call:
#   bash experiments/studies/h200_sft_8b_plan_picks.sh poll
W=${W:-/tmp/h200_sft_8b_plan_picks}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      mkdir -p \$O/sft
      OUT=\$O/sft TAG=$TAG timeout 600 bash $HERE/h200_sft_8b_end_of_run.sh >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 330 python experiments/shipped_configs.py --configs h200_sft_8b --steps 12 --timeout 310 \
        --set train.profile_step=6 --set engine.prefetch_depth=1 \
        --out \$O/h200_shipped_configs_${TAG}_h200_sft_8b_one_ahead.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 330 python experiments/shipped_configs.py --configs h200_sft_8b --steps 12 --timeout 310 \
        --set train.profile_step=6 --set engine.resident_layers=27 --set engine.kept_layers=0 \
        --out \$O/h200_shipped_configs_${TAG}_h200_sft_8b_27_resident.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 300 python -m megatrain_jax plan --config experiments/configs/h200_sft_8b.toml --exact \
        model.hf_checkpoint=/tmp/shipped_configs/llama3.1-8b/checkpoint data.path=/tmp/shipped_configs/llama3.1-8b/chat.jsonl \
        train.export_hf=/tmp/shipped_configs/plan_exact/hf > \$O/plan_exact.txt 2>&1 || fail=\$((fail + 1))"
