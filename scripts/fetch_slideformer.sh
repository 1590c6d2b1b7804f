#!/usr/bin/env bash
# Bring the peer SlideFormer (github.com/RegiaYoung/SlideFormer, DAC 2026) into .peers/slideformer/ (git-ignored):
# its code is never committed here; experiments/peers/slideformer_bench.py imports it from there.
#
#   bash scripts/fetch_slideformer.sh            # clone the pinned commit (needs github.com)
#   bash scripts/fetch_slideformer.sh --check    # only check .peers/slideformer against its MANIFEST.json
#   SLIDEFORMER_COMMIT=<sha> bash scripts/fetch_slideformer.sh   # another commit (record why)
#
# With github.com reachable: a depth-1 fetch of the pinned commit replaces .peers/slideformer/ (its .git removed, so
# the folder stays small enough to carry to the GPU machine), and MANIFEST.json is rewritten with the commit and
# every file's sha256. Where a MANIFEST.json was already there (a copy assembled file by file from a stored index of
# public code, when GitHub was unreachable), each of its files is first compared with the clone's and the
# differences are printed, so that copy can be judged.
# Without github.com: it says so and checks the present copy against its MANIFEST.json (path, source commit and
# sha256 of each file; pinned_commit is the upstream commit it stands for).
# On the GPU machine nothing is fetched: carry .peers/slideformer (and .whl, see scripts/build_peer_wheels.sh).
set -euo pipefail

URL="https://github.com/RegiaYoung/SlideFormer"
PINNED="${SLIDEFORMER_COMMIT:-3840d73c5e6db26c5421c9e636b07512be62d02a}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.peers/slideformer"
PY="${PYTHON:-python3}"

check_manifest() {  # 0 when every file of $1/MANIFEST.json has its sha256
  "$PY" - "$1" <<'EOF'
import hashlib, json, pathlib, sys
root = pathlib.Path(sys.argv[1])
m = json.loads((root / "MANIFEST.json").read_text())
bad = []
for f in m["files"]:
    p = root / f["path"]
    if not p.is_file():
        bad.append(f"missing  {f['path']}")
    elif hashlib.sha256(p.read_bytes()).hexdigest() != f["sha256"]:
        bad.append(f"changed  {f['path']}")
commits = sorted({f.get("commit") for f in m["files"] if f.get("commit")})
print(f"{root}: {len(m['files'])} files, pinned_commit {m['pinned_commit']} ({m.get('how_obtained', '')[:60]}...)")
print(f"  file versions from commits: {', '.join(c[:8] for c in commits)}")
print("\n".join("  " + b for b in bad) if bad else "  all files match MANIFEST.json")
sys.exit(1 if bad else 0)
EOF
}

git -C "$ROOT" check-ignore -q "$DEST" || { echo "ERROR: $DEST is not git-ignored (add /.peers/ to .gitignore)" >&2; exit 2; }

if [[ "${1:-}" == "--check" ]]; then
  [[ -f "$DEST/MANIFEST.json" ]] || { echo "no $DEST/MANIFEST.json: run this script where github.com is reachable" >&2; exit 1; }
  check_manifest "$DEST"; exit $?
fi

if ! timeout 30 git ls-remote --exit-code "$URL" HEAD >/dev/null 2>&1; then
  echo "github.com is unreachable from here: cannot clone $URL at $PINNED."
  if [[ -f "$DEST/MANIFEST.json" ]]; then
    echo "Keeping the present copy; its MANIFEST.json records each file's upstream commit and sha256:"
    check_manifest "$DEST"; exit $?
  fi
  echo "No copy in $DEST. Run this script on a machine that reaches github.com and bring $DEST here." >&2
  exit 1
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
git -C "$TMP" init -q clone
git -C "$TMP/clone" fetch -q --depth 1 "$URL" "$PINNED"
git -C "$TMP/clone" checkout -q --detach FETCH_HEAD
GOT="$(git -C "$TMP/clone" rev-parse HEAD)"
[[ "$GOT" == "$PINNED"* ]] || { echo "ERROR: fetched $GOT, wanted $PINNED" >&2; exit 1; }

if [[ -f "$DEST/MANIFEST.json" ]]; then
  echo "== the present copy against the clone of $GOT"
  "$PY" - "$DEST" "$TMP/clone" <<'EOF' || true
import hashlib, json, pathlib, sys
old, new = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
m = json.loads((old / "MANIFEST.json").read_text())
for f in m["files"]:
    p = new / f["path"]
    state = ("same" if p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest() == f["sha256"]
             else "DIFFERS" if p.is_file() else "NOT IN CLONE")
    print(f"  {state:12s} {f['path']}  (copy from {(f.get('commit') or f['source'])[:40]})")
EOF
fi

rm -rf "$TMP/clone/.git"
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$TMP/clone" "$DEST"
"$PY" - "$DEST" "$GOT" "$URL" <<'EOF'
import hashlib, json, pathlib, sys
root, commit, url = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
files = [{"path": str(p.relative_to(root)), "commit": commit, "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
          "bytes": p.stat().st_size} for p in sorted(root.rglob("*")) if p.is_file()]
(root / "MANIFEST.json").write_text(json.dumps(
    {"repo": "RegiaYoung/SlideFormer", "url": url, "pinned_commit": commit,
     "variant": "whole tree; the runner uses the single-GPU top level (scripts/main_bench.py's path), not multi_gpu/",
     "how_obtained": f"git fetch --depth 1 {url} {commit} (scripts/fetch_slideformer.sh); .git removed",
     "files": files}, indent=1) + "\n")
print(f"{root}: {len(files)} files at {commit}, {sum(f['bytes'] for f in files) / 2**20:.1f} MiB")
EOF
