#!/bin/bash
# The whole side-by-side comparison v12-v14 (issue 33) on the H100 box, three calls back to back on one warm
# machine (build/ is kept between them):
#   V=v12 bash experiments/studies/side_by_side_v12.sh a   # host, 8k
#   V=v12 bash experiments/studies/side_by_side_v12.sh b   # 32k, 98k (--resume)
#   V=v12 bash experiments/studies/side_by_side_v12.sh c   # 7b (--resume); from v13 on, then the shipped
#                                                       # h100_3p5b_32k as written (20 steps)
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}  # results names carry the commit they ran at
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p build/sbs
F=build/sbs/h100_side_by_side_${V:-v12}.json
sbs() { PYTHONPATH=/tmp/site:. python experiments/side_by_side.py --out $F --only "$@" | tail -30; cp $F* "$OUT"/; tail -3 $F.log; }
case $1 in
  a) sbs host,8k ;;
  b) sbs 32k,98k --resume ;;
  c) sbs 7b --resume
     [ "${V:-v12}" != v12 ] && PYTHONPATH=. timeout 250 python experiments/shipped_configs.py --configs h100_3p5b_32k \
       --steps 20 --timeout 230 --out $OUT/h100_shipped_configs_${TAG}_h100_3p5b_32k.json 2>&1 | tail -n 6 ;;
esac
