#!/bin/bash
# The side-by-side comparison v11 (issue 33) and two shipped configs on the H100 box, three calls back to back on one warm machine (build/ is kept between them):
#   bash experiments/studies/side_by_side_v11.sh a   # side_by_side host,8k; then the shipped h100_3p5b_98k as written
#   bash experiments/studies/side_by_side_v11.sh b   # side_by_side 32k,98k (--resume)
#   bash experiments/studies/side_by_side_v11.sh c   # side_by_side 7b (--resume); then the shipped h100_sft_8b as written
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}  # results names carry the commit they ran at
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p build/sbs
F=build/sbs/h100_side_by_side_v11.json
sbs() { PYTHONPATH=/tmp/site:. python experiments/side_by_side.py --out $F --only "$@" | tail -40; cp $F* "$OUT"/; tail -3 $F.log; }
shipped() {
  PYTHONPATH=. timeout $2 python experiments/shipped_configs.py --configs $1 --steps 20 --timeout $(($2 - 20)) \
    --out $OUT/h100_shipped_configs_${TAG}_$1.json 2>&1 | tail -n 8
}
case $1 in
  a) sbs host,8k; shipped h100_3p5b_98k 250 ;;
  b) sbs 32k,98k --resume ;;
  c) sbs 7b --resume; shipped h100_sft_8b 380 ;;
esac
