#!/usr/bin/env bash
# Build the wheels that DeepSpeed needs on an offline GPU machine, into .whl/ at the repo root (git-ignored).
#
#   bash scripts/build_deepspeed_wheel.sh            # on a machine with internet; no GPU or torch needed
#
# - deepspeed: built from the PyPI sdist with DS_BUILD_OPS=0, so no op is compiled here and the wheel is pure
#   Python (py3-none-any); its ops (cpu_adam for ZeRO offload) JIT-compile on the GPU machine at first use,
#   with that machine's torch, g++ and ninja. DS_ACCELERATOR=cuda only records 'cuda' as the build's
#   accelerator in deepspeed/git_version_info_installed.py (torch is not needed for that).
# - the runtime dependencies of deepspeed that the GPU image lacks: pydantic (+ pydantic-core for CPython 3.12
#   on manylinux x86_64, annotated-types, typing-inspection, typing-extensions >= 4.16 which pydantic needs)
#   and hjson. The image already has torch, numpy, packaging, psutil, py-cpuinfo, msgpack, ninja, einops,
#   tqdm (/work/.library/device/KINDS.md).
#
# On the GPU machine (offline):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:.
set -euo pipefail

DS_VERSION="${DS_VERSION:-0.19.8}"
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.whl"
# Exact pins: the GPU machine installs with --no-deps, so this list is the whole dependency closure.
DEPS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0 hjson==3.1.0)
PLATFORM_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
                --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$OUT"
git -C "$ROOT" check-ignore -q "$OUT/x.whl" || echo "WARNING: $OUT is not git-ignored" >&2

# One version of each distribution in .whl/, or the --no-deps install there fails: drop our old ones first.
for n in deepspeed pydantic pydantic_core annotated_types typing_inspection typing_extensions hjson; do
  rm -f "$OUT"/${n}-*.whl
done

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "== deepspeed $DS_VERSION sdist"
"$PY" -m pip download -q --no-deps --no-binary :all: "deepspeed==$DS_VERSION" -d "$TMP/sdist"
echo "== building the deepspeed wheel (DS_BUILD_OPS=0: ops JIT-compile on the GPU machine)"
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$PY" -m pip wheel -q --no-deps --no-cache-dir -w "$TMP/built" \
  "$TMP"/sdist/deepspeed-"$DS_VERSION".tar.gz
cp "$TMP"/built/deepspeed-"$DS_VERSION"-py3-none-any.whl "$OUT"/   # fails loudly if the tag is not pure

echo "== runtime dependencies missing on the GPU image"
"$PY" -m pip download -q --no-deps "${PLATFORM_FLAGS[@]}" -d "$OUT" "${DEPS[@]}"

echo "== check"
"$PY" - "$OUT" "$DS_VERSION" <<'EOF'
import collections, pathlib, re, sys, zipfile
out, version = pathlib.Path(sys.argv[1]), sys.argv[2]
wheels = sorted(out.glob("*.whl"))
names = collections.Counter(re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower() for w in wheels)
dupes = [n for n, c in names.items() if c > 1]
assert not dupes, f"more than one version of {dupes} in {out}: the --no-deps install would fail"
ds = out / f"deepspeed-{version}-py3-none-any.whl"
with zipfile.ZipFile(ds) as z:
    info = z.read("deepspeed/git_version_info_installed.py").decode()
    assert "'cpu_adam': False" in info, "an op was prebuilt; expected DS_BUILD_OPS=0"
    for need in ("deepspeed/ops/csrc/adam/cpu_adam.cpp", "deepspeed/ops/op_builder/cpu/cpu_adam.py"):
        assert need in z.namelist(), f"{need} missing: the cpu_adam JIT build would fail"
total = 0
for w in wheels:
    total += w.stat().st_size
    print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
print(f"{total / 2**20:8.2f} MiB  total in {out}")
assert total < 30 * 2**20, "wheels exceed 30 MiB"
EOF
