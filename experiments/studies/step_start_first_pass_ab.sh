#!/bin/bash
# One GPU (one H200, or one H200 of nvidia-h200-x2: PREFIX names the files, h200 or h200x2), one long_run.sh job
# of ~10 minutes (two calls): why the step's first host pass takes 2-3x the others at the 3.5B 32K row's step
# start (issue 51; experiments/studies/NOTES.md, 2026-12-01):
# 1. the io part's copy home held to the head (engine_patch_ab.py's io_home_at_head) against the engine as is,
#    two rounds, each with a timeline;
# 2. the same two arms traced (step_start_copies.py), the traces packed;
# 3. this host's rates for the step-time model (measure_speeds.py);
# 4. the host's first pass beside copies, in the results schema (first_pass_beside_copies.py; an idle gap before
#    each pass changed nothing at c856fc2, so it is not run again).
#
#   PREFIX=h200x2 MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/step_start_first_pass_ab.sh start   # then:
#   PREFIX=h200x2 bash experiments/studies/step_start_first_pass_ab.sh poll
# No peers needed. Files back: 4 results, the traces' tarball, stages.log, job and mem logs.
P=${PREFIX:?set PREFIX to h200 or h200x2}
W=${W:-/tmp/step_start_first_pass_ab}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      timeout 420 python experiments/studies/engine_patch_ab.py --rounds 2 \
        --arms 3p5b_32k_nothing_resident,3p5b_32k_nothing_resident+io_home_at_head \
        --out \$O/${P}_io_home_at_head_ab_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 300 python experiments/studies/step_start_copies.py --trace-dir /tmp/step_start_copies \
        --arms 3p5b_32k_nothing_resident,3p5b_32k_nothing_resident+io_home_at_head \
        --tar \$O/${P}_step_start_traces_$TAG.tar.gz \
        --out \$O/${P}_step_start_copies_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 120 python experiments/measure_speeds.py \
        --out \$O/${P}_measure_speeds_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      timeout 60 python experiments/studies/first_pass_beside_copies.py \
        --out \$O/${P}_first_pass_beside_copies_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))"
