#!/bin/bash
# One H200 of nvidia-h200-x2 (the 251 GiB, 32-core host), one long_run.sh job of at most ~27 minutes (the stages'
# timeouts): issue 51's rows left open after the x2 job of db50998, each writing its own results file (TAG: the
# commit, for the names; MEGATRAIN_GIT_COMMIT: the full one). First, ~1 minute: the head's loss alone at the 32B row's
# shape, its logits made once against the checkpointed chunks (studies/head_loss_ab.py).
# Then, in order of what they decide:
# 1. side_by_side.py --only 13b,13b_zero3: 13B at 32K, ours with the plan's layout, SlideFormer (its fastest
#    switches) and DeepSpeed ZeRO-3 with its parameters on the GPU at micro-batches 16 and 8 (micro-batch 4, a hand
#    setting, ran 2,107.8 tokens/s at db50998; fully offloaded it does not fit this host): the 2x ZeRO-3 bar at
#    ZeRO-3's best micro-batch, and the 1.3x SlideFormer bar again;
# 2. the 32B scale row through `megatrain-jax train` as shipped (experiments/configs/h200x2_32b_32k.toml; bar 500
#    model TFLOP/s; 493.2 at db50998), with the head's logits made once;
# 3. the same with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (+2.1% / +1.5% on one 13B block recomputing /
#    keeping its products, h200x2_layer_compute_head_triton_e637172.json): whether it holds for the whole 32B step.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200x2_zero3_best_32b_head.sh start    # then, at once:
#   bash experiments/studies/h200x2_zero3_best_32b_head.sh poll
# Carry .peers/slideformer and .whl (DeepSpeed's wheels from scripts/build_deepspeed_wheel.sh; SlideFormer's pinned
# transformers and liger-kernel from scripts/build_peer_wheels.sh, into /tmp/site_slideformer, where
# experiments/peers/slideformer_bench.py looks first). Each stage has its own timeout; the job's exit status is
# the number that failed. At most 8 files come back: 4 results, the side-by-side log, stages.log, job and mem logs.
W=${W:-/tmp/h200x2_zero3_best_32b_head}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 240 python experiments/studies/head_loss_ab.py --hidden 5120 --vocab 152064 --tokens 32768 \
        --out \$O/h200x2_head_loss_ab_32b_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 840 python experiments/side_by_side.py --only 13b,13b_zero3 --sf-flags '--no-timing --double-buffer' \
        --steps 4 --ds-steps 3 --out \$O/h200x2_side_by_side_13b_zero3_$TAG.json >> \$O/stages.log 2>&1 \
        || fail=\$((fail + 1))
      timeout 390 python experiments/shipped_configs.py --configs h200x2_32b_32k --steps 8 --timeout 370 \
        --out \$O/h200x2_32b_32k_cli_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 390 python experiments/shipped_configs.py \
        --configs h200x2_32b_32k --steps 8 --timeout 370 --out \$O/h200x2_32b_32k_cli_triton_off_$TAG.json \
        >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
