#!/bin/bash
# One H200 (the 16-core nvidia-h200), one long_run.sh job of ~15 minutes: issue 51's measurements that need no
# larger host, each writing its own results file (TAG: the commit, for the names; MEGATRAIN_GIT_COMMIT: the full one):
# 1. transfer_queues.py: this machine's link as the engine copies a block (is the 16-core host's the x2's?);
# 2. measure_speeds.py: the rates a calibration file carries, the link measured with a block's float32 state;
# 3. layer_compute.py --xla-flags: one 13B block's forward and backward under XLA_FLAGS variants, each with its
#    trace's summary (compute time by kernel kind, the top kernels): where the ~20 ms of each backward outside the
#    matrix products go, and whether a flag buys >= 2% in both layouts;
# 4. side_by_side.py --only 32k --without zero3: the 3.5B 32K row where the model fits, the plan's own layout
#    against plain JAX and torch (Liger from .whl/slideformer), issue 51's 0.95x bar.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_block_flags_fits.sh start    # then, at once:
#   bash experiments/studies/h200_block_flags_fits.sh poll
# Carry .whl/slideformer (scripts/build_peer_wheels.sh). Each stage has its own timeout, so one that hangs leaves
# the next their time; the job's exit status is the number of stages that failed.
set -u
export W=${W:-/tmp/h200_block_flags_fits} PYTHONPATH=${PYTHONPATH:-.}
TAG=${TAG:-$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)}
LONG="$(dirname "$0")/long_run.sh"
FLAGS=";--xla_gpu_enable_triton_gemm=false;--xla_gpu_enable_command_buffer=;--xla_gpu_exhaustive_tiling_search=true;--xla_gpu_enable_cublaslt=true"

case ${1:-poll} in
  start)
    exec bash "$LONG" start bash -c "
      fail=0; O=\$JOB_OUT  # at most 8 files come back: 4 results, stages.log, side_by_side's own log, job and mem logs
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_liger \
        .whl/slideformer/liger_kernel-*.whl 2>&1 | tail -n 2
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 150 python experiments/studies/transfer_queues.py \
        --out \$O/h200_transfer_queues_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 240 python experiments/measure_speeds.py --out \$O/h200_measure_speeds_$TAG.json \
        >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 480 python experiments/studies/layer_compute.py --halves ours --trace-dir /tmp/layer_traces_$TAG \
        --xla-flags='$FLAGS' --out \$O/h200_layer_compute_flags_$TAG.json >> \$O/stages.log 2>&1 \
        || fail=\$((fail + 1))
      timeout 420 python experiments/side_by_side.py --only 32k --without zero3 --steps 4 --ds-steps 3 \
        --out \$O/h200_fits_3p5b_32k_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      exit \$fail" ;;
  poll) exec bash "$LONG" poll ;;
  *) echo "usage: MEGATRAIN_GIT_COMMIT=<sha> bash $0 start|poll"; exit 2 ;;
esac
