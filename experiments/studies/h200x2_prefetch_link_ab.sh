#!/bin/bash
# One H200 of nvidia-h200-x2 (the 251 GiB, 32-core host), one long_run.sh job of at most ~20 minutes (the stages'
# timeouts; ~13 expected): two questions about the copies to the GPU, and the 32B row as now shipped.
# 1. bench.py, one script run: the 3.5B rows with nothing resident, one block fetched ahead (as they ran) against
#    two (`*_depth2`): on the GPU a copy lands only after the compute queued before it was issued, so one block
#    ahead each block's copy may wait for the forward before it (the abfe3c3 timeline: forwards 29-31 ms apart
#    against ~20 ms of compute); and the 8K row with 6 and 7 blocks updated on the GPU beside the plan's 5 (the link
#    at 60 GB/s both ways, as the step-time model keeps it, or the 81.7 measure_speeds.py measured);
# 2. the 32B row through `megatrain-jax train` as shipped, with no XLA_FLAGS: Triton's products off by the engine's
#    own compiler options (507.2 model TFLOP/s with the flag in XLA_FLAGS at fca06c7);
# 3. the same with engine.prefetch_depth=2 (one block more on the GPU; the plan fits the kept blocks to it).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200x2_prefetch_link_ab.sh start    # then, at once:
#   bash experiments/studies/h200x2_prefetch_link_ab.sh poll
# Afterwards, on the CPU: studies/fetch_waits.py on the bench file says what paced each forward.
# Carry nothing beyond the tree. Each stage has its own timeout; the job's exit status is the number that failed.
# Files back: 3 results, stages.log, job and mem logs.
W=${W:-/tmp/h200x2_prefetch_link_ab}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 480 python experiments/bench.py --configs 3p5b_32k_nothing_resident,3p5b_32k_nothing_resident_depth2,\
3p5b_8k_nothing_resident,3p5b_8k_nothing_resident_depth2,3p5b_8k_nothing_resident_gpu_updated_6,\
3p5b_8k_nothing_resident_gpu_updated_7 --timeline-steps 2 --out \$O/h200x2_3p5b_prefetch_link_ab_$TAG.json >> \$O/stages.log 2>&1 \
        || fail=\$((fail + 1))
      timeout 390 python experiments/shipped_configs.py --configs h200x2_32b_32k --steps 8 --timeout 370 \
        --out \$O/h200x2_32b_32k_cli_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 390 python experiments/shipped_configs.py --configs h200x2_32b_32k --steps 8 --timeout 370 \
        --set engine.prefetch_depth=2 --out \$O/h200x2_32b_32k_cli_depth2_$TAG.json >> \$O/stages.log 2>&1 \
        || fail=\$((fail + 1))"
