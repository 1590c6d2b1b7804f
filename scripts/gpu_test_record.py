"""Run the tests that only a GPU runs (cuDNN's packed attention, the Mosaic-GPU kernels, the GPU-only remat and
GPT-OSS checks: skipped on the CPU) on this machine's GPU, and write a record of what passed.

    PYTHONPATH=. python scripts/gpu_test_record.py --out $OUT/h200_gpu_tests.json

The record (committed under experiments/results/, cited by docs/performance.md; the results schema of
docs/results.md, one run: the test files) names the commit, the device, and each test's outcome; a test that skipped here is recorded as skipped, so a record made on the wrong GPU
says so instead of passing quietly. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The test files holding GPU-only tests (each skips them elsewhere); the whole file runs, so the record also
# shows the CPU-side tests of these files passing on the GPU backend.
GPU_FILES = ("tests/test_attention.py", "tests/test_gpt_oss.py", "tests/test_remat.py")


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                     else "skipped" if "skipped" in kinds else "passed")
    return out


def device() -> dict:
    import jax
    d = jax.devices()[0]
    return {"name": d.device_kind, "platform": d.platform, "count": jax.device_count(),
            "compute_capability": getattr(d, "compute_capability", None), "cpu_cores": os.cpu_count(),
            "host_ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path of the record (JSON)")
    ap.add_argument("files", nargs="*", default=list(GPU_FILES), help="test files (default: the GPU ones)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                              *args.files], cwd=REPO)
        tests = outcomes(junit)
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    counts = {k: sum(v == k for v in tests.values()) for k in ("passed", "failed", "error", "skipped")}
    record = {"name": Path(args.out).stem, "command": "PYTHONPATH=. python scripts/gpu_test_record.py "
              + " ".join(argv if argv is not None else sys.argv[1:]), "git_commit": commit, "device": device(),
              "date": datetime.date.today().isoformat(),
              "runs": [{"system": "megatrain_jax", "status": "ok" if rc == 0 else f"error: pytest exit {rc}",
                        "files": args.files, "counts": counts, "tests": tests}]}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(counts), "->", args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
