"""Write each example config's memory line from the plan, so the comments say what ``megatrain-jax plan``
prints (tests/test_memory_plan.py checks that they agree).

    python scripts/plan_comments.py          # rewrite the lines in experiments/configs/*.toml
    python scripts/plan_comments.py --check  # exit 1 if any line is stale

A config names its machine in the line itself, ``# plan (host 125 GiB, GPU 80 GiB): host X GiB, GPU Y GiB``;
X and Y are the plan's totals for that host RAM (``megatrain-jax plan --config FILE --host-gib 125
--gpu-gib 80`` prints the breakdown).

A fine-tuning config names a Hugging Face folder (``[model] hf_checkpoint``) that is not in the repository;
its line ``# plan shape: PRESET`` names the preset of the same shape, which the plan uses while the folder
is absent.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatrain_jax.cli.run_config import RunConfig, parse_config  # noqa: E402
from megatrain_jax.engine.config import AUTO  # noqa: E402
from megatrain_jax.plan import GiB, Machine, plan, resolve  # noqa: E402

LINE = re.compile(r"^# plan \(host (?P<host>\d+) GiB, GPU (?P<gpu>\d+) GiB\): .*$", re.MULTILINE)
SHAPE = re.compile(r"^# plan shape: (?P<preset>\S+)$", re.MULTILINE)


def load_example(path: Path) -> RunConfig:
    """The example config at ``path``; one naming an HF folder that is not here gets the preset of its
    ``# plan shape:`` line instead (the weights are loaded part by part, so the plan is the same)."""
    text = path.read_text()
    raw = tomllib.loads(text)
    folder = raw.get("model", {}).get("hf_checkpoint")
    if folder is not None and not (REPO / folder / "config.json").exists():
        shape = SHAPE.search(text)
        if shape is None:
            raise ValueError(f"{path.name} names hf_checkpoint {folder!r}, which is not here: add a "
                             f"'# plan shape: PRESET' line naming a preset of the same shape")
        raw["model"] = {k: v for k, v in raw["model"].items() if k != "hf_checkpoint"} | {"preset": shape["preset"]}
    return parse_config(raw, str(path))


def comment_line(path: Path, host_gib: int, gpu_gib: int) -> str:
    """The memory line of the config at ``path`` planned for that machine."""
    cfg = load_example(path)
    model, d, engine = cfg.model.build(), cfg.data, cfg.engine
    end = dict(packed=d.mode == "packed", export=bool(cfg.train.export_hf),
               checkpoints=cfg.train.for_fit().checkpointing)  # as train plans
    if AUTO in (engine.resident_layers, engine.kept_layers):  # the layout picked on that machine (no GPU kind named)
        engine = resolve(model, engine, d.batch_size, d.seq_len, Machine(host_gib * GiB, gpu_gib * GiB), **end
                         ).engine_cfg
    p = plan(model, engine, d.batch_size, d.seq_len, host_ram_bytes=host_gib * GiB, gpu_bytes=gpu_gib * GiB,
             detect=False, **end)
    return (f"# plan (host {host_gib} GiB, GPU {gpu_gib} GiB): host {p.host_total / GiB:.1f} GiB, "
            f"GPU {p.gpu_total / GiB:.1f} GiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report stale lines")
    args = ap.parse_args()
    stale = 0
    for path in sorted((REPO / "experiments" / "configs").glob("*.toml")):
        text = path.read_text()
        found = LINE.search(text)
        if found is None:
            print(f"{path.name}: no '# plan (host N GiB, GPU M GiB): ...' line")
            continue
        line = comment_line(path, int(found["host"]), int(found["gpu"]))
        if line != found.group(0):
            stale += 1
            print(f"{path.name}: {line}")
            if not args.check:
                path.write_text(text[:found.start()] + line + text[found.end():])
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
