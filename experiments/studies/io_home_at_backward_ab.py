"""The io part's updated state sent home at the backward's start instead of at its visit (issue 51, the 3.5B 32K
row): an A/B of a change that is not in the engine, made here by patching it in a child process.

    PYTHONPATH=. python experiments/studies/io_home_at_backward_ab.py --out $OUT/io_home_ab.json [--rounds 2]

Why (``first_pass_beside_copies.py``, ``h200x2_first_pass_beside_copies_c856fc2.json``): on the x2 host a first
pass over a 7B block takes 21.8 ms alone and 30.8 ms beside a copy from the GPU to pinned memory. With the io part
updated on the GPU (the 3.5B 32K row's pick), its visit, the forward's first op, sends its masters and moments
home (12 bytes a parameter, ~3.1 GB): that copy runs beside the first blocks' first passes, which pace the
forward. In the backward the host has room (its second passes end well before the backward does).

Each round runs bench.py's ``3p5b_32k_nothing_resident`` (the plan's layout) twice, each in its own process: as
the engine is (``as_is``), and with the copy held (``held``: ``engine_patch_ab.py``'s ``io_home_at_head``): the
visit sends only the compute copy home and keeps the updated masters and moments on the GPU; the step's first
head op sends them home (every part visited that step). The next bring of the io part's state, later in that
backward, reads them from host memory as before; the numbers are the same, only when bytes move changes. Rounds
alternate the arms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # engine_patch_ab.py
sys.path.insert(0, os.path.dirname(HERE))  # child.py

from engine_patch_ab import run_arm, run_arms  # noqa: E402

CONFIG = "3p5b_32k_nothing_resident"
ARMS = {"as_is": CONFIG, "held": CONFIG + "+io_home_at_head"}  # engine_patch_ab.py's patch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--arm", choices=tuple(ARMS), default=None, help=argparse.SUPPRESS)  # a child's arm
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.arm:
        run_arm(ARMS[args.arm], args.steps, args.out)
        return
    from child import results_header
    got = run_arms(list(ARMS), args.rounds, args.steps, args.out, os.path.abspath(__file__))
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), "config": CONFIG, **got}, f, indent=1)
    print(json.dumps(got["step_time_s"]))


if __name__ == "__main__":
    main()
