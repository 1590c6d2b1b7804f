"""The io part's updated state sent home at the backward's start instead of at its visit (issue 51, the 3.5B 32K
row): an A/B of a change that is not in the engine, made here by patching it in a child process.

    PYTHONPATH=. python experiments/studies/io_home_at_backward_ab.py --out $OUT/io_home_ab.json [--rounds 2]

Why (``first_pass_beside_copies.py``, ``h200x2_first_pass_beside_copies_c856fc2.json``): on the x2 host a first
pass over a 7B block takes 21.8 ms alone and 30.8 ms beside a copy from the GPU to pinned memory. With the io part
updated on the GPU (the 3.5B 32K row's pick), its visit, the forward's first op, sends its masters and moments
home (12 bytes a parameter, ~3.1 GB): that copy runs beside the first blocks' first passes, which pace the
forward. In the backward the host has room (its second passes end well before the backward does).

Each round runs bench.py's ``3p5b_32k_nothing_resident`` (the plan's layout) twice, each in its own process: as
the engine is (``as_is``), and with the copy held (``held``): the visit sends only the compute copy home and
keeps the updated masters and moments on the GPU; the step's first head op sends them home (every part visited
that step). The next bring of the io part's state, later in that backward, reads them from host memory as
before; the numbers are the same, only when bytes move changes. Rounds alternate the arms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = os.path.dirname(HERE)
sys.path.insert(0, EXPERIMENTS)  # child.py, bench.py
sys.path.insert(0, os.path.dirname(EXPERIMENTS))

CONFIG = "3p5b_32k_nothing_resident"


def hold_state_until_head() -> None:
    """Patch the engine in this process: a visit sends only the compute copy home; the first head op of a pass
    sends the visited parts' masters and moments."""
    import jax

    from megatrain_jax.engine import passes
    from megatrain_jax.engine.parts import Part
    from megatrain_jax.engine.update.resident import DeviceUpdater

    def visit(self, brought, grads, scale, ok):
        new = self._visit(Part(*brought, None), grads, scale, ok)
        copy = None if new.stream is None else self.placement.to_host(new.stream)
        return Part(new.params, new.opt, copy), new.streamed()

    head = passes.PassRunner.head

    def head_sending_home(self, p, op):
        if op.micro == 0:
            for part in self.gpu_updated:
                record = self.state[part]
                leaf = jax.tree.leaves(record.params)[0]
                if leaf.sharding.memory_kind != "pinned_host":  # held since its visit
                    self.state[part] = Part(*self.placement.to_host((record.params, record.opt)), record.stream)
        return head(self, p, op)

    DeviceUpdater.visit = visit
    passes.PassRunner.head = head_sending_home
    passes.HANDLERS["head"] = head_sending_home


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--arm", choices=("as_is", "held"), default=None, help=argparse.SUPPRESS)  # a child's arm
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.arm:
        if args.arm == "held":
            hold_state_until_head()
        import bench
        bench.main(["--configs", CONFIG, "--steps", str(args.steps), "--timeline-steps", "2", "--out", args.out])
        return
    runs = []
    for r in range(args.rounds):
        for arm in (("as_is", "held") if r % 2 == 0 else ("held", "as_is")):
            part = f"{args.out}.{arm}{r}.json"
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--arm", arm, "--steps", str(args.steps),
                                   "--out", part], capture_output=True, text=True)
            print(proc.stdout[-2000:], proc.stderr[-3000:] if proc.returncode else "", flush=True)
            if proc.returncode or not os.path.exists(part):
                runs.append({"arm": arm, "round": r, "status": f"error: exit {proc.returncode}: {proc.stderr[-800:]}"})
                continue
            with open(part) as f:
                rec = json.load(f)["runs"][0]
            os.remove(part)
            runs.append({"arm": arm, "round": r, **rec})
    from child import results_header
    ok = {arm: [x["step_time_s"] for x in runs if x["arm"] == arm and x.get("step_time_s")] for arm in ("as_is", "held")}
    out = {**results_header(args.out, __file__), "config": CONFIG,
           "step_time_s": ok, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(ok))


if __name__ == "__main__":
    main()
