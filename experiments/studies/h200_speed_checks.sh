#!/bin/bash
# One H200 (125.9 GiB host), one device call (about 9 minutes): issue 51's next measurements, each writing its own
# results file under $OUT (TAG: the commit, for the file names; MEGATRAIN_GIT_COMMIT: the full one).
# 1. one Llama-2-13B block's forward and backward, ours (recomputing, and keeping its products) against
#    SlideFormer's layer (Liger, sdpa, checkpointed), with a profiler trace of each (layer_compute.py);
# 2. the host stage of side_by_side.py (the host AdamW throughput and the host's STREAM bandwidth) and the 8K
#    streamed pair (ours with nothing resident against SlideFormer): the host update's GB/s against STREAM in
#    one run (side_by_side's host_update_vs_stream);
# (The attention GPU-test record in the present schema, the committed one having no `runs`, is a call of its own:
#  PYTHONPATH=. python scripts/gpu_test_record.py --out $OUT/h200_gpu_tests_attention_<commit>.json tests/test_attention.py)
# Needs carry: .peers/slideformer and .whl/slideformer (scripts/fetch_slideformer.sh, scripts/build_peer_wheels.sh).
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}
set -u
export PYTHONPATH=.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_slideformer \
  .whl/slideformer/*.whl 2>&1 | tail -n 2
timeout 210 python experiments/studies/layer_compute.py --trace-dir /tmp/layer_traces_${TAG} \
  --out $OUT/h200_layer_compute_13b_${TAG}.json 2>&1 | tail -n 4
# the profiler's directories are too deep for the device's copy home: one archive instead
tar czf $OUT/layer_traces_${TAG}.tar.gz -C /tmp layer_traces_${TAG} && ls -la $OUT/layer_traces_${TAG}.tar.gz
timeout 360 python experiments/side_by_side.py --only host,streamed_8k \
  --out $OUT/h200_side_by_side_host_${TAG}.json 2>&1 | tail -n 30 | cut -c1-300
