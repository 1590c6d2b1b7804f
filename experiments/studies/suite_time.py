"""The test suite's time on two trees of the repository on this machine: the whole suite, and the tests both trees
have (same node id), from pytest's JUnit XML ("the suite takes no longer than before"). CPU only. Each run starts
with an empty JAX compilation cache (``MEGATRAIN_TEST_JAX_CACHE``: a fresh folder, as on a fresh CI machine), both
trees run with the same ``--workers`` (the README's test command: ``-n 2``), and ``--repeat N`` alternates them
(before, after, before, after, ...) so that a slow spell of the machine falls on both.

    python experiments/studies/suite_time.py --before /tmp/before_tree --after . --workers 2 --repeat 2 \
        --out experiments/results/cpu_suite_time.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def run_suite(tree: Path, xml: Path, workers: int = 0) -> dict:
    cache = tempfile.mkdtemp(prefix="suite_time_jax_cache_")  # cold, as on a fresh CI machine
    env = {**os.environ, "PYTHONPATH": str(tree), "MEGATRAIN_TEST_JAX_CACHE": cache}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                           *(["-n", str(workers)] if workers else [])],
                          cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    shutil.rmtree(cache, ignore_errors=True)
    cases = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        cases[f"{case.get('classname')}::{case.get('name')}"] = float(case.get("time", 0))
    return {"tree": str(tree), "wall_s": round(wall, 1), "exit_status": proc.returncode, "tests": len(cases),
            "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "", "cases": cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=0, help="pytest-xdist workers for both trees (the test command's -n)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each tree, alternating")
    args = ap.parse_args()
    runs = []
    for i in range(args.repeat):
        for name in ("before", "after"):
            tree = Path(getattr(args, name)).resolve()
            r = run_suite(tree, Path(f"/tmp/suite_{name}.xml"), args.workers)
            runs.append({"system": name, "repeat": i, **r})
            print(name, i, r["wall_s"], r["summary"], flush=True)
    common = sorted(set.intersection(*(set(r["cases"]) for r in runs)))
    commit = lambda tree: subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True,  # noqa: E731
                                         text=True).stdout.strip()
    result = {"name": Path(args.out).stem, "command": "python experiments/studies/suite_time.py " + " ".join(sys.argv[1:]),
              "git_commit": commit(args.after), "date": datetime.date.today().isoformat(),
              "device": {"name": "development machine (CPU)", "cpu_cores": os.cpu_count(),
                         "host_ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
              "workers": args.workers,
              "runs": [{"system": r["system"], "repeat": r["repeat"], "git_commit": commit(r["tree"]),
                        "wall_s": r["wall_s"], "tests": r["tests"], "exit_status": r["exit_status"],
                        "summary": r["summary"], "test_time_s": round(sum(r["cases"].values()), 1),
                        "common_tests_time_s": round(sum(r["cases"].get(c, 0) for c in common), 1)} for r in runs],
              "common_tests": len(common),
              "median_wall_s": {name: statistics.median(r["wall_s"] for r in runs if r["system"] == name)
                                for name in ("before", "after")}}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), [
        {k: r[k] for k in ("system", "wall_s", "tests", "common_tests_time_s")} for r in result["runs"]])


if __name__ == "__main__":
    main()
