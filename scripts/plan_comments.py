"""Write each example config's memory line from the plan, so the comments say what ``megatrain-jax plan``
prints (tests/test_memory_plan.py checks that they agree).

    python scripts/plan_comments.py          # rewrite the lines in experiments/configs/*.toml
    python scripts/plan_comments.py --check  # exit 1 if any line is stale

A config names its machine in the line itself, ``# plan (host 125 GiB, GPU 80 GiB): host X GiB, GPU Y GiB``;
X and Y are the plan's totals for that host RAM (``megatrain-jax plan --config FILE --host-gib 125
--gpu-gib 80`` prints the breakdown).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatrain_jax.cli.config_file import load_config  # noqa: E402
from megatrain_jax.memory_plan import GiB, plan  # noqa: E402

LINE = re.compile(r"^# plan \(host (?P<host>\d+) GiB, GPU (?P<gpu>\d+) GiB\): .*$", re.MULTILINE)


def comment_line(path: Path, host_gib: int, gpu_gib: int) -> str:
    """The memory line of the config at ``path`` planned for that machine."""
    cfg = load_config(path)
    p = plan(cfg.model.build(), cfg.engine, cfg.data.batch_size, cfg.data.seq_len, host_ram_bytes=host_gib * GiB,
             gpu_bytes=gpu_gib * GiB, packed=cfg.data.mode == "packed",
             loaded_copy=cfg.model.hf_checkpoint is not None, detect=False)
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
