#!/bin/bash
# One GPU, one call: the same bench.py configuration at an earlier commit and at this tree, alternating
# (before, after, before, after) so that a drift of the box falls on both; one results file each.
#   BEFORE=.before BEFORE_COMMIT=<sha> AFTER_COMMIT=<sha> bash experiments/studies/bench_before_after.sh 3p5b_32k NAME
# BEFORE is a copy of the earlier tree (e.g. `mkdir .before && git archive <sha> | tar x -C .before`, carried).
set -u
CFG=${1:-3p5b_32k}; NAME=${2:-h200_bench_before_after_$CFG}
START=$SECONDS
for round in a b; do
  if [ $round = b ] && [ $((SECONDS - START)) -gt ${ROUND_B_IF_UNDER_S:-280} ]; then
    echo "round b skipped: round a took $((SECONDS - START)) s"; break
  fi
  (cd "$BEFORE" && MEGATRAIN_GIT_COMMIT=$BEFORE_COMMIT PYTHONPATH=. timeout 280 python experiments/bench.py \
     --configs "$CFG" --append --name "${NAME}_before" --out "$OUT/${NAME}_before.json" 2>&1 | tail -n 2 | cut -c1-300)
  MEGATRAIN_GIT_COMMIT=$AFTER_COMMIT PYTHONPATH=. timeout 280 python experiments/bench.py \
     --configs "$CFG" --append --name "${NAME}_after" --out "$OUT/${NAME}_after.json" 2>&1 | tail -n 2 | cut -c1-300
done
python - "$OUT/${NAME}_before.json" "$OUT/${NAME}_after.json" <<'PY'
import json, statistics, sys
tok = [[r.get("tokens_per_s") for r in json.load(open(p))["runs"]] for p in sys.argv[1:]]
print("tokens/s before", tok[0], "after", tok[1])
b, a = (statistics.mean(t for t in x if t) for x in tok)
print(f"after / before = {a / b:.4f}")
PY
