#!/bin/bash
# One H200 (the 16-core, 125.9 GiB host), one long_run.sh job of ~12 minutes (two calls):
# 1. the step decision's copies home started where the decision is made (d1b0b87) against the engine before it
#    (engine_patch_ab.py's decision_copies_late), 3.5B at 32K tokens a step with nothing resident, the plan's
#    layout, two rounds in alternating order;
# 2. the two 3.5B pairs with nothing resident against SlideFormer with its fastest switches, in one script run;
# 3. the shipped h200_7b_32k through `megatrain-jax train` as written (20 steps);
# 4. the 13B block's products one at a time in each operand layout (gemm_layouts.py), in the results schema.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_streamed_pairs_checks.sh start    # then, at once:
#   bash experiments/studies/h200_streamed_pairs_checks.sh poll
# Carry .peers/slideformer and .whl (SlideFormer's pinned transformers and liger-kernel from
# scripts/build_peer_wheels.sh). The job's exit status is the number of stages that failed. Files back: 4 results,
# the side-by-side's log, stages.log, job and mem logs.
W=${W:-/tmp/h200_streamed_pairs_checks}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 420 python experiments/studies/engine_patch_ab.py --rounds 2 \
        --arms 3p5b_32k_nothing_resident,3p5b_32k_nothing_resident+decision_copies_late \
        --out \$O/h200_decision_copies_ab_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 420 python experiments/side_by_side.py --only streamed_32k,streamed_8k \
        --sf-flags '--no-timing --double-buffer' \
        --out \$O/h200_side_by_side_streamed_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 300 python experiments/shipped_configs.py --configs h200_7b_32k --steps 20 \
        --out \$O/h200_shipped_configs_${TAG}_h200_7b_32k.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 120 python experiments/studies/gemm_layouts.py \
        --out \$O/h200_gemm_layouts_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
