#!/bin/bash
# One H200 of nvidia-h200-x2 (the 251 GiB, 32-core host), one long_run.sh job of at most ~26 minutes (the stages' timeouts): issue 51's rows that
# need the larger host, each writing its own results file (TAG: the commit, for the names; MEGATRAIN_GIT_COMMIT:
# the full one). In order of what they decide:
# 1. the 32B scale row through `megatrain-jax train` as shipped (experiments/configs/h200x2_32b_32k.toml; bar 500
#    model TFLOP/s; 485.9 at beaff67);
# 2. side_by_side.py --only 13b: 13B at 32K, ours with the plan's layout against SlideFormer (its fastest switches):
#    the 1.3x bar;
# 3. bench.py --configs 13b_32k with a profiled step (--trace-dir): whether the ~0.5 s between the serialized
#    step's compute and the overlapped step is the GPU idling or its kernels running slower beside the copies;
# 4. side_by_side.py --only 13b_zero3 --resume (into stage 2's file, one script's record): DeepSpeed ZeRO-3 at two
#    settings (everything offloaded; parameters on the GPU with 80% of the optimizer state offloaded), never run at
#    13B, last because each of its runs takes minutes: the 2x ZeRO-3 bar.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200x2_scale_zero3_trace.sh start    # then, at once:
#   bash experiments/studies/h200x2_scale_zero3_trace.sh poll
# Carry .peers/slideformer and .whl (DeepSpeed's wheels from scripts/build_deepspeed_wheel.sh; SlideFormer's pinned
# transformers and liger-kernel from scripts/build_peer_wheels.sh, into /tmp/site_slideformer, where
# experiments/peers/slideformer_bench.py looks first). Each stage has its own timeout; the job's exit status is the number that failed.
W=${W:-/tmp/h200x2_scale_zero3_trace}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 420 python experiments/shipped_configs.py --configs h200x2_32b_32k --steps 8 --timeout 400 \
        --out \$O/h200x2_32b_32k_cli_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 420 python experiments/side_by_side.py --only 13b --sf-flags '--no-timing --double-buffer' \
        --steps 4 --out \$O/h200x2_side_by_side_13b_zero3_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 240 python experiments/bench.py --configs 13b_32k --warmup 2 --steps 3 --trace-dir /tmp/bench_trace \
        --out \$O/h200x2_13b_32k_trace_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 420 python experiments/side_by_side.py --only 13b_zero3 --resume --ds-steps 3 \
        --out \$O/h200x2_side_by_side_13b_zero3_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
