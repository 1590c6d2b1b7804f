#!/bin/bash
# One H200 of nvidia-h200-x2 (the 32-core, 251 GiB host), one long_run.sh job (two calls, ~12 minutes), each row
# with every precision mode's host kernel timed at the start (host_kernel.mode_rates, 8d1cf7f on):
# 1. the 3.5B 32K pair with nothing resident against SlideFormer with its fastest switches (side_by_side.py), beside
#    h200x2_side_by_side_streamed_32k_dc44261.json (1.177x): the plan's pick at this host's own rate, and the
#    prediction's error there;
# 2. the shipped l40s_sft_14b under a 48 GB card's and a 240 GiB host's caps (as d827385 ran it: −16.9% against the
#    model then, before host timing), 20 steps, step 8 profiled (each lane beside the model's), the export off.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200x2_host_timed_checks.sh start   # then, at once:
#   bash experiments/studies/h200x2_host_timed_checks.sh poll
# Carry .peers/slideformer (scripts/fetch_slideformer.sh) and .whl (scripts/build_peer_wheels.sh). Files back: 2
# results, the side-by-side's log, stages.log, job and mem logs. The job's exit status is the number of stages that
# failed.
W=${W:-/tmp/h200x2_host_timed_checks}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 420 python experiments/side_by_side.py --only streamed_32k --sf-flags '--no-timing --double-buffer' \
        --out \$O/h200x2_side_by_side_streamed_32k_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.326 MEGATRAIN_HOST_RAM_GIB=240 timeout 600 python experiments/shipped_configs.py \
        --configs l40s_sft_14b --steps 20 --timeout 580 --set train.profile_step=8 \
        --out \$O/h200x2_capped_l40s_sft_14b_profiled_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
