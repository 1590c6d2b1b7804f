"""A/B runs of schedule changes that are not in the engine, made by patching it in a child process (issue 51):
measure a change before building it.

    PYTHONPATH=. python experiments/studies/engine_patch_ab.py --out $OUT/ab.json \
        --arms 3p5b_32k_nothing_resident,3p5b_32k_nothing_resident_gpu_updated_1+blocks_brought_in_backward \
        [--rounds 1] [--steps 10]

Each arm is one of bench.py's configs, optionally ``+PATCH`` (several: ``+A+B``); each runs in its own process
(bench.py's record: the step time, two instrumented steps' timeline), rounds alternating the arms' order. The
patches (``PATCHES``) change when bytes move, never the numbers: a CPU check of each against the engine as it is
(the same masters and moments, bit for bit) belongs with the test that builds it.

- ``io_home_at_head``: a GPU-updated part's visit sends only its compute copy home and keeps its updated masters
  and moments on the GPU until the pass's first head op, which sends them (the forward's host passes then run
  without that copy beside them).
- ``blocks_brought_in_backward``: the blocks updated on the GPU (``gpu_updated_layers``) have their masters and
  moments brought during the backward of the pass that updates them (one pass a step: with ``accumulate_steps``
  > 1 the passes stay as they are), each right after that block's fetch for
  the backward (as the io part's are), instead of at the next step's start, where the forward waits for them.
- ``blocks_brought_after_head``: the same, each brought right after the pass's last head op (the backward's
  start), so that they land long before the backward's end (the first blocks' fetches for the backward come
  last, and so would their brings).
- ``decision_copies_late``: the step decision as the engine made it before d1b0b87: its clip scale and verdict
  on the device only, copied home when the host worker reads them (its first update of the step), so the
  copies may queue behind what the next forward has sent home meanwhile;
- ``decision_copies_started``: as from d1b0b87 until its program wrote them home: those copies started when the
  decision is made.
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


def io_home_at_head() -> None:
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
                if jax.tree.leaves(record.params)[0].sharding.memory_kind != "pinned_host":  # held since its visit
                    self.state[part] = Part(*self.placement.to_host((record.params, record.opt)), record.stream)
        return head(self, p, op)

    DeviceUpdater.visit = visit
    passes.PassRunner.head = head_sending_home
    passes.HANDLERS["head"] = head_sending_home


def blocks_brought_in_backward(after_head: bool = False) -> None:
    from megatrain_jax.engine import passes, schedule
    from megatrain_jax.engine.parts import PartId

    step_ops = schedule.step_ops

    def moved(n_layers, n_micro, depth=1, update=True, offload=0, visited=(), visit_io=False, bring_io=False):
        ops = step_ops(n_layers, n_micro, depth, update, offload, visited, visit_io, bring_io)
        blocks = {PartId.block(i) for i in visited}
        if not update or not blocks:  # accumulate_steps > 1: the passes as they are (brought at the step's start)
            return ops
        ops = [op for op in ops if not (op.kind == "bring" and op.part in blocks)]  # not at the step's start
        out, head_seen, placed = [], False, set()
        for op in ops:
            out.append(op)
            if op.kind == "head" and op.micro == n_micro - 1:
                head_seen = True  # blocks still on the GPU from the forward: brought before the backward starts
                stay = [b for b in sorted(blocks, key=lambda q: q.index) if after_head or b.layer >= n_layers - depth]
                out += [schedule.Op("bring", b) for b in stay]
                placed |= set(stay)
            elif head_seen and op.kind == "fetch" and op.part in blocks and op.part not in placed:
                out.append(schedule.Op("bring", op.part))
                placed.add(op.part)
        return out

    bring = passes.PassRunner.bring

    def bring_any(self, p, op):
        if not op.part.is_io and op.part not in self.brought:  # brought for the next visit, pending or not
            self.brought[op.part] = self._copier.submit(self._bring_landed, self.state[op.part])
            return self.brought[op.part]
        return bring(self, p, op)

    schedule.step_ops = moved
    passes.PassRunner.bring = bring_any
    passes.HANDLERS["bring"] = bring_any


def decision_on_device(start_home: bool = False) -> None:
    """The step decision as the engine made it before its program wrote the scale and verdict home: every output
    on the device, copied home when the worker reads it; ``start_home`` starts those copies when the decision is
    made (d1b0b87)."""
    import jax

    from megatrain_jax.engine.update import policy

    init = policy.UpdatePolicy.__init__

    def made_on_device(self, *args, **kwargs):
        init(self, *args, **kwargs)
        decide = self._decide
        self._decide = jax.jit(lambda sq, loss: decide.__wrapped__(sq, loss))  # its outputs where XLA puts them

    policy.UpdatePolicy.__init__ = made_on_device
    if start_home:
        decision_init = policy.StepDecision.__init__

        def started(self, *args):
            decision_init(self, *args)
            for x in self.home:
                x.copy_to_host_async()

        policy.StepDecision.__init__ = started


PATCHES = {"io_home_at_head": io_home_at_head, "blocks_brought_in_backward": blocks_brought_in_backward,
           "blocks_brought_after_head": lambda: blocks_brought_in_backward(after_head=True),
           "decision_copies_late": decision_on_device,
           "decision_copies_started": lambda: decision_on_device(start_home=True)}


def run_arms(arms: list[str], rounds: int, steps: int, out: str, script: str, name_of=lambda arm: arm) -> dict:
    """Each arm in its own process (``script --arm ARM``), rounds alternating the order; their bench records."""
    runs = []
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else list(reversed(arms))):
            part = f"{out}.{name_of(arm)}{r}.json"
            proc = subprocess.run([sys.executable, script, "--arm", arm, "--steps", str(steps), "--out", part],
                                  capture_output=True, text=True)
            print(proc.stdout[-2000:], proc.stderr[-3000:] if proc.returncode else "", flush=True)
            if proc.returncode or not os.path.exists(part):
                runs.append({"arm": name_of(arm), "round": r,
                             "status": f"error: exit {proc.returncode}: {proc.stderr[-800:]}"})
                continue
            with open(part) as f:
                rec = json.load(f)["runs"][0]
            os.remove(part)
            runs.append({"arm": name_of(arm), "round": r, **rec})
    return {"step_time_s": {name_of(a): [x["step_time_s"] for x in runs if x["arm"] == name_of(a) and x.get("step_time_s")]
                            for a in arms}, "runs": runs}


def run_arm(arm: str, steps: int, out: str) -> None:
    """In the child: apply the arm's patches, then bench.py's run of its config."""
    config, *patches = arm.split("+")
    for name in patches:
        PATCHES[name]()
    import bench
    bench.main(["--configs", config, "--steps", str(steps), "--timeline-steps", "2", "--out", out])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=None, help="comma-separated bench configs, each with +PATCH names")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # a child's arm
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.arm:
        run_arm(args.arm, args.steps, args.out)
        return
    if not args.arms:
        ap.error("--arms is required")
    arms = args.arms.split(",")
    unknown = [p for a in arms for p in a.split("+")[1:] if p not in PATCHES]
    if unknown:
        ap.error(f"unknown patch(es) {unknown}; choose from {sorted(PATCHES)}")
    from child import results_header
    got = run_arms(arms, args.rounds, args.steps, args.out, os.path.abspath(__file__))
    with open(args.out, "w") as f:
        json.dump({**results_header(args.out, __file__), **got}, f, indent=1)
    print(json.dumps(got["step_time_s"]))


if __name__ == "__main__":
    main()
