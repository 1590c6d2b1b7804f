#!/bin/bash
# One H200 of nvidia-h200-x2 (the 251 GiB, 32-core host), one long_run.sh job of ~10 minutes (two calls): issue
# 51's two 13B rows on one GPU against SlideFormer (its fastest switches), each pair in one script run, with the
# product's share of the GPU (bench.py's since 2668f06): 8K tokens a step again (SlideFormer's step has spread
# 3.58-3.91 s across calls, and the 2.5x bar lies inside that spread), then 32K (not yet run with that share).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200x2_13b_pairs.sh start    # then, at once:
#   bash experiments/studies/h200x2_13b_pairs.sh poll
# Carry .peers/slideformer and .whl (SlideFormer's pinned transformers and liger-kernel from
# scripts/build_peer_wheels.sh). The job's exit status is the number of stages that failed. Files back: 2 results
# and their logs, stages.log, job and mem logs.
W=${W:-/tmp/h200x2_13b_pairs}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 480 python experiments/side_by_side.py --only 13b_8k --sf-flags '--no-timing --double-buffer' \
        --out \$O/h200x2_side_by_side_13b_8k_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 540 python experiments/side_by_side.py --only 13b --sf-flags '--no-timing --double-buffer' \
        --out \$O/h200x2_side_by_side_13b_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
