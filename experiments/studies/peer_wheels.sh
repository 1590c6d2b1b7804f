#!/bin/bash
# Installs the peers' wheels carried to a GPU machine (nothing can be downloaded there): DeepSpeed's
# (scripts/build_deepspeed_wheel.sh) from .whl into /tmp/site, and SlideFormer's pinned transformers and
# liger-kernel (scripts/build_peer_wheels.sh) from .whl/slideformer into /tmp/site_slideformer, where
# experiments/peers/slideformer_bench.py looks first. Run from the repository root; either folder may be absent.
for pair in ".whl:/tmp/site" ".whl/slideformer:/tmp/site_slideformer"; do
  src=${pair%%:*} dst=${pair#*:}
  ls "$src"/*.whl > /dev/null 2>&1 || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dst" \
    "$src"/*.whl 2>&1 | tail -n 2
done
