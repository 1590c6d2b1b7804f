"""The test suite's time on two trees of the repository, one after the other on this machine: the whole
suite, and the tests both trees have (same node id), from pytest's JUnit XML (issue 30: "the suite takes no
longer than before"). CPU only. ``--workers N`` also runs the after tree with N pytest-xdist workers, as its
test command does (per-test times then overlap: compare wall times).

    python experiments/studies/suite_time.py --before /tmp/before_tree --after . --out experiments/results/cpu_suite_time.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def run_suite(tree: Path, xml: Path, workers: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                           *(["-n", str(workers)] if workers else [])],
                          cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
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
    ap.add_argument("--workers", type=int, default=0,
                    help="also run the after tree with this many pytest-xdist workers (its test command's -n)")
    args = ap.parse_args()
    runs = {}
    for name in ("before", "after"):
        tree = Path(getattr(args, name)).resolve()
        runs[name] = run_suite(tree, Path(f"/tmp/suite_{name}.xml"))
        print(name, runs[name]["wall_s"], runs[name]["summary"], flush=True)
    if args.workers:
        name = f"after, -n {args.workers}"
        runs[name] = run_suite(Path(args.after).resolve(), Path("/tmp/suite_after_workers.xml"), args.workers)
        print(name, runs[name]["wall_s"], runs[name]["summary"], flush=True)
    common = sorted(set(runs["before"]["cases"]) & set(runs["after"]["cases"]))
    commit = lambda tree: subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True,  # noqa: E731
                                         text=True).stdout.strip()
    result = {"name": Path(args.out).stem, "command": "python experiments/studies/suite_time.py " + " ".join(sys.argv[1:]),
              "git_commit": commit(args.after), "date": datetime.date.today().isoformat(),
              "device": {"name": "development machine (CPU)", "cpu_cores": os.cpu_count()},
              "runs": [{"system": name, "git_commit": commit(r["tree"]), "wall_s": r["wall_s"], "tests": r["tests"],
                        "exit_status": r["exit_status"], "summary": r["summary"],
                        "test_time_s": round(sum(r["cases"].values()), 1),
                        "common_tests_time_s": round(sum(r["cases"].get(c, 0) for c in common), 1)}
                       for name, r in runs.items()],
              "common_tests": len(common)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), [
        {k: r[k] for k in ("system", "wall_s", "tests", "common_tests_time_s")} for r in result["runs"]])


if __name__ == "__main__":
    main()
