#!/bin/bash
# One H200 (125.9 GiB host), one long_run.sh job (two calls, ~15 minutes):
# 1. the 8B block's kernels (layer_compute.py, our half: two llama3.1-8b blocks, 4 rows of 4,096 tokens, each
#    layout's step traced and summarized by kernel kind), on whole rows and on rows packed as h200_sft_8b's
#    generated chats (15 documents of 30 tokens, then the padding as one run): the products' and attention's
#    rates at this shape, which the step-time model puts ~15% slow on this config;
# 2. the shipped h200_sft_8b as written (27 resident blocks, two ahead) with its export
#    (h200_sft_8b_end_of_run.sh: memory through the export, the export loaded back);
# 3. the same with `resident_layers` and `kept_layers` "auto" (the plan's pick with the lean host margin).
# Each stage's files are packed into one tarball (at most 8 files come back from a call).
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_sft_8b_auto_margin.sh start   # then, at once after each call:
#   bash experiments/studies/h200_sft_8b_auto_margin.sh poll
W=${W:-/tmp/h200_sft_8b_auto_margin}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      pack() { tar czf \$O/\$1.tgz -C \$O \$1 && rm -rf \$O/\$1; }
      mkdir -p \$O/kernels
      for p in whole 15x30; do
        timeout 300 python experiments/studies/layer_compute.py --halves ours --preset llama3.1-8b --rows 4 --seq 4096 \
          \$( [ \$p = whole ] || echo --packed \$p ) --trace-dir /tmp/traces_\$p \
          --out \$O/kernels/h200_block_kernels_8b_\${p}_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      done
      pack kernels
      mkdir -p \$O/written \$O/auto
      OUT=\$O/written TAG=$TAG timeout 560 bash $HERE/h200_sft_8b_end_of_run.sh >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      pack written
      OUT=\$O/auto TAG=$TAG NAME=auto SETS='engine.resident_layers=auto engine.kept_layers=auto' \
        timeout 560 bash $HERE/h200_sft_8b_end_of_run.sh >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      pack auto"
