#!/bin/bash
# One H200 (any kind; one GPU), one device call (~4 minutes): what the 3.5B 32K row's step start waits behind
# (issue 51): step_start_copies.py's traces of three steps run back to back, the plan's row as is, before d1b0b87's
# fix (engine_patch_ab.py's decision_copies_late) and with the io part updated on the host.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_step_start_trace.sh
# Files back: the results file and the traces' tarball.
set -u
export PYTHONPATH=${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
TAG=$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)
O=${OUT:-/tmp/out}; mkdir -p "$O"
python experiments/studies/step_start_copies.py --trace-dir /tmp/step_start_copies \
  --arms 3p5b_32k_nothing_resident,3p5b_32k_nothing_resident+decision_copies_late,3p5b_32k_nothing_resident_io_on_host \
  --tar "$O/h200_step_start_traces_$TAG.tar.gz" --out "$O/h200_step_start_copies_$TAG.json"
