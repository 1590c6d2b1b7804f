#!/usr/bin/env bash
# Download the wheels the peer SlideFormer needs on the offline GPU machine, into .whl/slideformer/ (git-ignored,
# under .whl/). Its code itself comes from scripts/fetch_slideformer.sh (.peers/slideformer/, also git-ignored).
#
#   bash scripts/build_peer_wheels.sh            # on a machine with internet; no GPU or torch needed
#
# SlideFormer's torch-2.11 profile (its requirements-models.txt at 69350a42) pins transformers==5.5.4,
# accelerate==1.13.0, liger-kernel==0.7.0 and ninja==1.13.0. Against the GPU image (KINDS.md: torch 2.11.0+cu130,
# triton 3.6.0, transformers 5.17.0, tokenizers 0.23.2, accelerate 1.15.0, ninja, numpy, psutil, nvidia-ml-py):
# - liger-kernel 0.7.0 (pure Python; needs only torch and triton) is missing, and SlideFormer cannot run without it:
#   transformer_layer.py imports utils/legacy_fused_linear_cross_entropy.py, which imports liger's Triton kernels
#   (the README's "optional" applies to the model patches only).
# - transformers 5.17 breaks SlideFormer's forward: utils/model_compat.py calls
#   create_causal_mask(..., cache_position=...), a keyword transformers removed after 5.5 (5.17 raises TypeError).
#   So transformers 5.5.4 (pure Python) travels too, with tokenizers 0.22.2 (5.5.4 checks tokenizers<=0.23.0 at
#   import; the image's 0.23.2 fails that check and 0.23.0 was never released). Its other requirements (huggingface-hub
#   >=1.5,<2, regex, safetensors, typer, tqdm, pyyaml) are in the image.
# - accelerate (1.15 in the image) and ninja are there; flash-attn is not (its PyPI release is an sdist that needs a
#   CUDA build): the runner uses attn_implementation="sdpa", which SlideFormer supports.
# These go in their own folder and their own install target, so the other runs (megatrain_jax, DeepSpeed, which
# install .whl/*.whl into /tmp/site) keep the image's transformers.
#
# On the GPU machine (offline):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site_slideformer .whl/slideformer/*.whl
# experiments/peers/slideformer_bench.py puts /tmp/site_slideformer first on sys.path (--site).
set -euo pipefail

PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.whl/slideformer"
# Exact pins: the GPU machine installs with --no-deps, so this list is the whole closure beyond the image.
PURE=(liger-kernel==0.7.0 transformers==5.5.4)
BINARY=(tokenizers==0.22.2)
PLATFORM_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
                --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$OUT"
git -C "$ROOT" check-ignore -q "$OUT/x.whl" || echo "WARNING: $OUT is not git-ignored" >&2
rm -f "$OUT"/*.whl  # one version of each distribution, or the --no-deps install fails

echo "== pure-Python wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$OUT" "${PURE[@]}"
echo "== binary wheels for CPython 3.12, manylinux x86_64"
"$PY" -m pip download -q --no-deps "${PLATFORM_FLAGS[@]}" -d "$OUT" "${BINARY[@]}"

echo "== check"
"$PY" - "$OUT" <<'EOF'
import collections, pathlib, re, sys, zipfile
out = pathlib.Path(sys.argv[1])
wheels = sorted(out.glob("*.whl"))
names = collections.Counter(re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower() for w in wheels)
assert not [n for n, c in names.items() if c > 1], f"more than one version of a distribution in {out}"
for need in ("liger_kernel", "transformers", "tokenizers"):
    assert names.get(need) == 1, f"{need} wheel missing from {out}"
liger = next(w for w in wheels if w.name.startswith("liger_kernel-"))
with zipfile.ZipFile(liger) as z:
    src = z.read("liger_kernel/ops/cross_entropy.py").decode()
    # the vendored legacy FLCE in SlideFormer calls the kernel with these arguments (liger >= 0.6.4)
    for arg in ("token_accuracy_ptr", "HAS_GRADIENTS", "RETURN_TOKEN_ACCURACY"):
        assert arg in src, f"liger's cross-entropy kernel has no {arg}: SlideFormer's FLCE call would fail"
tf = next(w for w in wheels if w.name.startswith("transformers-"))
with zipfile.ZipFile(tf) as z:
    mask = z.read("transformers/masking_utils.py").decode()
    sig = mask[mask.index("def create_causal_mask("):][:600]
    assert "cache_position" in sig, "this transformers' create_causal_mask takes no cache_position (SlideFormer passes it)"
total = 0
for w in wheels:
    total += w.stat().st_size
    print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
print(f"{total / 2**20:8.2f} MiB  total in {out}")
assert total < 24 * 2**20, "wheels exceed 24 MiB (carry holds 64 MiB in all, with .whl/'s DeepSpeed set and .peers)"
EOF
