#!/bin/bash
# Sourced by a study that runs on one GPU (one H200, or one H200 of nvidia-h200-x2) as one long_run.sh job (more
# than one device call):
#
#   W=${W:-/tmp/<study>}; . "$(dirname "$0")/one_gpu_job.sh"
#   one_gpu_job "${1:-poll}" "
#     timeout 420 python experiments/... --out \$O/<file>_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
#     ..."
#
# It sets the environment every such job runs in (GPU 0 only, NVLink multicast off, the peers' wheels on
# PYTHONPATH) and TAG (the commit's first 7 characters, for the files' names: MEGATRAIN_GIT_COMMIT, or HEAD). `start`
# installs the peers' wheels (peer_wheels.sh), then runs the stages, each writing under $O (the job's output
# folder, which comes back with every poll) and adding 1 to `fail` where it fails: the job's exit status is the
# number that failed. `poll` waits on it (issue it at once after each call: the machine goes back after 30 s idle).
set -u
export W PYTHONPATH=/tmp/site:${PYTHONPATH:-.} CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0
TAG=${TAG:-$(echo "${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" | cut -c1-7)}
HERE="$(dirname "$0")"

one_gpu_job() {
  case $1 in
    start) exec bash "$HERE/long_run.sh" start bash -c "fail=0; O=\$JOB_OUT; bash $HERE/peer_wheels.sh
      $2
      exit \$fail" ;;
    poll) exec bash "$HERE/long_run.sh" poll ;;
    *) echo "usage: MEGATRAIN_GIT_COMMIT=<sha> bash $0 start|poll"; exit 2 ;;
  esac
}
