#!/usr/bin/env bash
# Parts updated on the GPU without staying there (engine.gpu_updated_parts, issue 51's 32K row) on one H200:
# 3.5B with nothing resident against SlideFormer at 8K and 32K tokens a step (ours with the plan's own pick), the
# engine's tests on the GPU, and the shipped h200_7b_32k through `megatrain-jax train` with the count "auto".
# Carry .peers/slideformer and .whl/slideformer (scripts/fetch_slideformer.sh, scripts/build_peer_wheels.sh).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_gpu_updated_parts.sh compare  # side_by_side, ~8 min
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_gpu_updated_parts.sh tests    # tests, then 7B 32K
set -u
export PYTHONPATH=.
TAG=${MEGATRAIN_GIT_COMMIT:0:7}
case "${1:-compare}" in
  compare)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site_slideformer .whl/slideformer/*.whl 2>&1 | tail -n 2
    timeout 570 python experiments/side_by_side.py --only streamed_8k,streamed_32k \
      --out "$OUT/h200_side_by_side_gpu_updated_$TAG.json" | tail -30 ;;
  tests)
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_engine.py \
      -k "gpu_updated or resident or norm_first_equals" --junitxml="$OUT/h200_engine_gpu_updated_$TAG.xml" | tail -5
    timeout 360 python experiments/shipped_configs.py --configs h200_7b_32k --steps 8 \
      --set engine.gpu_updated_parts=auto --timeout 340 --out "$OUT/h200_7b_32k_gpu_updated_auto_$TAG.json" | tail -15 ;;
esac
