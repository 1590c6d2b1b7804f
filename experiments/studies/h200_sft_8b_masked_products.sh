#!/bin/bash
# One H200 (125.9 GiB host), one long_run.sh job (~10 minutes): are the 8B block's matrix products faster where
# most of the backward's gradients are zeros? layer_compute.py (our half, two llama3.1-8b blocks, 4 rows of 4,096
# tokens, traced) on whole rows with every token in the loss, then with only each row's first 450 in it (as
# h200_sft_8b's generated chats: 15 x 30 tokens, the rest padding out of the loss), the attention the same; then the
# shipped h200_sft_8b as written with its export (h200_sft_8b_end_of_run.sh). Each stage's files in one tarball.
#
#   MEGATRAIN_GIT_COMMIT=<sha> bash experiments/studies/h200_sft_8b_masked_products.sh start   # then, if needed:
#   bash experiments/studies/h200_sft_8b_masked_products.sh poll
W=${W:-/tmp/h200_sft_8b_masked_products}; . "$(dirname "$0")/one_gpu_job.sh"
one_gpu_job "${1:-poll}" "
      pack() { tar czf \$O/\$1.tgz -C \$O \$1 && rm -rf \$O/\$1; }
      mkdir -p \$O/kernels \$O/written
      for n in 4096 450; do
        timeout 300 python experiments/studies/layer_compute.py --halves ours --preset llama3.1-8b --rows 4 --seq 4096 \
          --loss-tokens \$n --trace-dir /tmp/traces_\$n \
          --out \$O/kernels/h200_block_kernels_8b_loss\${n}_$TAG.json >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      done
      pack kernels
      OUT=\$O/written TAG=$TAG timeout 560 bash $HERE/h200_sft_8b_end_of_run.sh >> \$O/stages.log 2>&1 || fail=\$((fail + 1))
      pack written"
