#!/bin/bash
# One H200 of nvidia-h200-x2 (the 251 GiB, 32-core host), one long_run.sh job of ~8 minutes (at most ~16 at the
# stages' timeouts): issue 51's rows after two blocks fetched ahead became the engine's default (prefetch_depth 2).
# 1. side_by_side.py --only streamed_8k,streamed_32k: 3.5B with nothing resident against SlideFormer (its fastest
#    switches) at 8K and 32K tokens a step, one script run (bar 1.2x each; 1.166x and 1.104x at e637172, one block
#    ahead);
# 2. the 32B scale row through `megatrain-jax train` as now shipped (experiments/configs/h200x2_32b_32k.toml,
#    prefetch_depth 2; 546.0 model TFLOP/s with `--set engine.prefetch_depth=2` at 94b326e).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200x2_streamed_pairs_32b.sh start    # then, at once:
#   bash experiments/studies/h200x2_streamed_pairs_32b.sh poll
# Carry .peers/slideformer and .whl (SlideFormer's pinned transformers and liger-kernel from
# scripts/build_peer_wheels.sh). The job's exit status is the number of stages that failed. Files back: 2 results,
# the side-by-side log, stages.log, job and mem logs.
W=${W:-/tmp/h200x2_streamed_pairs_32b}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 480 python experiments/side_by_side.py --only streamed_8k,streamed_32k \
        --sf-flags '--no-timing --double-buffer' --steps 4 \
        --out \$O/h200x2_side_by_side_streamed_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 390 python experiments/shipped_configs.py --configs h200x2_32b_32k --steps 8 --timeout 370 \
        --out \$O/h200x2_32b_32k_cli_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
