#!/bin/bash
# One H200 of nvidia-h200-x2 (the 251 GiB, 32-core host), one long_run.sh job of ~8 minutes (at most ~14 at the
# stages' timeouts): issue 51's 13B row at 8K tokens a step with the gradients of the parts updated on the GPU kept
# there in bfloat16 (engine.device_grad_dtype, bench.py's 13b_8k since 2026-11-30: the plan fits 25 resident blocks
# instead of 22), against SlideFormer (its fastest switches) in the same script run; then the A/B's other arm, the
# same row with those gradients in float32 (13b_8k_float32_device_grads), in the same job.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200x2_device_grads_13b_8k.sh start    # then, at once:
#   bash experiments/studies/h200x2_device_grads_13b_8k.sh poll
# Carry .peers/slideformer and .whl (SlideFormer's pinned transformers and liger-kernel from
# scripts/build_peer_wheels.sh). The job's exit status is the number of stages that failed. Files back: 2 results,
# stages.log, job and mem logs.
W=${W:-/tmp/h200x2_device_grads_13b_8k}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 480 python experiments/side_by_side.py --only 13b_8k --sf-flags '--no-timing --double-buffer' \
        --out \$O/h200x2_side_by_side_13b_8k_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 300 python experiments/bench.py --configs 13b_8k_float32_device_grads --steps 10 \
        --out \$O/h200x2_13b_8k_float32_device_grads_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
