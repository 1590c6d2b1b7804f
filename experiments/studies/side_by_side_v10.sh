# Issue 33's comparison on one H100 box, in three calls of under 10 minutes on the same warm machine:
#   bash experiments/studies/side_by_side_v10.sh "host,8k"; ... "32k,98k" resume; ... "7b" resume
# The file lives under build/ (git-ignored, kept between calls on a warm machine) and is copied to $OUT.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p build/sbs
PYTHONPATH=/tmp/site:. python experiments/side_by_side.py --out build/sbs/h100_side_by_side_v10.json --only "$1" ${2:+--resume} \
  | tail -40
cp build/sbs/h100_side_by_side_v10.json* "$OUT"/
tail -5 build/sbs/h100_side_by_side_v10.json.log
