#!/bin/bash
# The kept_layers sweep of 3.5B at 32K tokens on the H100 box (one warm machine, calls back to back):
#   bash experiments/studies/h100_kept_layers_32k.sh a   # bench: 3p5b_32k, r16_k2, r12_k7 (kept_layers sweep, first half)
#   bash experiments/studies/h100_kept_layers_32k.sh b   # bench: r8_k12, r4_k16 (second half)
# Each configuration in its own process (its own pinned-pool cap), appended to one results file.
set -u
F=$OUT/h100_kept_layers_32k.json
[ -f build/kept_layers_32k.json ] && cp build/kept_layers_32k.json $F
bench() {
  for c in "$@"; do
    PYTHONPATH=. timeout 290 python experiments/bench.py --configs $c --steps 8 --append --name h100_kept_layers_32k \
      --out $F 2>&1 | grep -v "^W\|Warning" | tail -n 3
  done
  mkdir -p build && cp $F build/kept_layers_32k.json
}
case $1 in
  a) bench 3p5b_32k 3p5b_32k_r16_k2 3p5b_32k_r12_k7 ;;
  b) bench 3p5b_32k_r8_k12 3p5b_32k_r4_k16 ;;
esac
