#!/bin/bash
# One H200 (any kind; one GPU), one long_run.sh job of ~9 minutes (two calls): the step decision written home by
# its own program against d1b0b87's copies started when it is made (engine_patch_ab.py's
# decision_copies_started), and with block 0's state brought at the backward's start (blocks_brought_after_head),
# 3.5B 32K with nothing resident, two rounds; then the 32K pair against SlideFormer (its fastest switches).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_decision_home_ab.sh start    # then, at once:
#   bash experiments/studies/h200_decision_home_ab.sh poll
# Carry .peers/slideformer and .whl. Files back: 2 results, the side-by-side's log, stages.log, job and mem logs.
W=${W:-/tmp/h200_decision_home_ab}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 480 python experiments/studies/engine_patch_ab.py --rounds 2 \
        --arms 3p5b_32k_nothing_resident,3p5b_32k_nothing_resident+decision_copies_started,3p5b_32k_nothing_resident+blocks_brought_after_head \
        --out \$O/h200_decision_home_ab_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 240 python experiments/side_by_side.py --only streamed_32k --sf-flags '--no-timing --double-buffer' \
        --out \$O/h200_side_by_side_streamed_32k_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
