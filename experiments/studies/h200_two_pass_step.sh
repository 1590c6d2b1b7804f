#!/usr/bin/env bash
# The exact two-pass step (engine.norm_first) on one H200: the engine's tests on the GPU, and a 21B run through
# `megatrain-jax train` (Qwen2.5-32B's shape cut to 40 layers, capacity mode with 8-bit moments and bfloat16
# gradients home), once with the two-pass step and once as the plan picks without it, each against the plan
# (host and GPU peaks, the predicted step).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_two_pass_step.sh tests   # the tests, then the two-pass run
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_two_pass_step.sh one_pass # the one-pass run
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_two_pass_step.sh m7v5     # 7-bit m, 5-bit v: tests, host
#                                                   # kernels against 8 bits, the 21B run with m7v5
set -u
export PYTHONPATH=.
TAG=${MEGATRAIN_GIT_COMMIT:0:7}
SHAPE=(--configs h200_7b_32k --set model.preset=32b --set model.layers=40 --set engine.master_dtype=bfloat16
       --set engine.moment_dtype=q8 --set engine.host_grad_dtype=bfloat16 --set engine.resident_layers=0
       --set engine.resident_io=false --set engine.micro_batches=2 --set optimizer.warmup_steps=2 --steps 6)
case "${1:-tests}" in
  tests)
    # the bitwise comparisons need a deterministic backward (XLA's scatter-add is not, by default)
    XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 240 python -m pytest -q -p no:cacheprovider \
      tests/test_engine.py -k "norm_first" --junitxml="$OUT/h200_engine_norm_first_deterministic_$TAG.xml" | tail -5
    timeout 330 python experiments/shipped_configs.py "${SHAPE[@]}" --set engine.norm_first=true --timeout 320 \
      --out "$OUT/h200_21b_q8_two_pass_cli_$TAG.json" | tail -15 ;;
  one_pass)
    timeout 560 python experiments/shipped_configs.py "${SHAPE[@]}" --timeout 540 \
      --out "$OUT/h200_21b_q8_one_pass_cli_$TAG.json" | tail -15 ;;
  m7v5)
    XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 200 python -m pytest -q -p no:cacheprovider \
      tests/test_engine.py tests/test_m7v5_moments.py tests/test_precision.py -k "norm_first or m7v5 or record" \
      --junitxml="$OUT/h200_engine_m7v5_norm_first_deterministic_$TAG.xml" | tail -5
    timeout 120 python experiments/host_adam_bench.py --params 1024 --reps 3 \
      --systems megatrain_jax_q8_kernel_bf16_grad,megatrain_jax_m7v5_kernel_bf16_grad,megatrain_jax_capacity_kernel \
      --out "$OUT/h200_host_adamw_m7v5_$TAG.json" | tail -4
    timeout 300 python experiments/shipped_configs.py "${SHAPE[@]}" --set engine.moment_dtype=m7v5 \
      --set engine.norm_first=true --timeout 290 --out "$OUT/h200_21b_m7v5_two_pass_cli_$TAG.json" | tail -15 ;;
esac
