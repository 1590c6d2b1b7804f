#!/bin/bash
# One H200 (any kind; one GPU): where a 13B block's time goes beside its matrix products (issue 51's per-layer
# compute item). layer_compute.py's own half (two 13B blocks, 16 x 2048 tokens, recomputing and keeping their
# products) with one profiled step of each, summarized into the results file (trace_summary.py's top_fusions:
# the kernels that are neither products nor attention, by HLO module), and XLA's optimized HLO of every program
# dumped and packed with the kept step's trace, so that each fusion can be read on the CPU afterwards.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_block_kernels.sh
# Files back: the results file and one tarball (the HLO text after optimization; the kept step's Perfetto trace
# where the tarball stays under 15 MB with it).
set -u
export PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
TAG=$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)
O=${OUT:-/tmp/out}; mkdir -p "$O"
rm -rf /tmp/block_kernels && mkdir -p /tmp/block_kernels/hlo
python experiments/studies/layer_compute.py --halves ours --trace-dir /tmp/block_kernels/traces \
  "--xla-flags=--xla_dump_to=/tmp/block_kernels/hlo --xla_dump_hlo_as_text" \
  --out "$O/h200_block_kernels_$TAG.json"; rc=$?
cd /tmp/block_kernels
find hlo -name '*after_optimizations.txt' > files.txt
trace=$(find traces -path '*kept2*' -name perfetto_trace.json.gz | head -n 1)
tar czf "$O/h200_block_hlo_$TAG.tar.gz" -T files.txt ${trace:+"$trace"}
if [ "$(stat -c %s "$O/h200_block_hlo_$TAG.tar.gz")" -gt 15000000 ]; then
  tar czf "$O/h200_block_hlo_$TAG.tar.gz" -T files.txt
fi
ls -la "$O"
exit $rc
