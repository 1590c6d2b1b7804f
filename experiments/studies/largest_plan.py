"""The largest model of a preset's shape (more or fewer layers) that the memory plan fits on a machine, in
a given host layout, as ``megatrain-jax train`` would pick the rest (``lean_engine``): the prediction a
capacity run is measured against (issue 35). Planned, not measured.

    PYTHONPATH=. python experiments/studies/largest_plan.py --preset 32b --host-gib 251.8 --gpu-gib 139.8 \\
        --mode q8 --out experiments/results/cpu_largest_plan_q8.json

``--mode``: ``capacity`` (bfloat16 masters and moments) or ``q8`` (8-bit moments, bfloat16 host gradients).
The GPU gets ``--gpu-fraction`` of ``--gpu-gib`` (what ``train`` gives XLA). Batches of ``--rows`` x
``--seq-len`` tokens in ``--micro-batches``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: megatrain_jax
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: child.py

from child import results_header  # noqa: E402

from megatrain_jax import EngineConfig, preset  # noqa: E402
from megatrain_jax.plan import GiB, lean_engine, plan  # noqa: E402

MODES = {"capacity": dict(master_dtype="bfloat16"),
         "q8": dict(master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16")}


def fitting(name: str, layers: int, engine: EngineConfig, rows: int, seq_len: int, kw: dict) -> dict:
    """The plan of ``layers`` layers of preset ``name`` with what ``lean_engine`` picks: a ``runs`` entry (the
    results schema's model and workload; ``status`` whether the plan fits, its host and GPU totals)."""
    cfg = preset(name, layers=layers)
    picked, said = lean_engine(cfg, engine, rows, seq_len, **kw)
    p = plan(cfg, picked, rows, seq_len, detect=False, **kw)
    return {"system": "megatrain_jax", "kind": "plan (not measured)", "layers": layers,
            "model": {"layers": layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "heads": cfg.heads,
                      "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size, "params": cfg.param_count()},
            "params": cfg.param_count(), "seq_len": seq_len, "tokens_per_step": rows * seq_len,
            "master_dtype": picked.master_dtype, "status": "fits" if p.fits else "does not fit", "fits": p.fits,
            "host_gib": round(p.host_total / GiB, 1), "gpu_gib": round(p.gpu_total / GiB, 1),
            "grads_on_gpu": picked.grads_on_gpu, "said": said}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--host-gib", type=float, required=True)
    ap.add_argument("--gpu-gib", type=float, required=True)
    ap.add_argument("--gpu-fraction", type=float, default=0.95)
    ap.add_argument("--mode", choices=sorted(MODES), default="q8")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--max-layers", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    engine = EngineConfig(micro_batches=args.micro_batches, **MODES[args.mode])
    kw = dict(host_ram_bytes=int(args.host_gib * GiB), gpu_bytes=int(args.gpu_gib * args.gpu_fraction * GiB))
    base = preset(args.preset)
    tried = {}

    def fits(n: int) -> bool:
        tried[n] = fitting(args.preset, n, engine, args.rows, args.seq_len, kw)
        return tried[n]["fits"]

    # host memory grows with layers: the most that fit, bisected (the lean pick keeps it monotone enough)
    lo, hi = 0, args.max_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    same = fitting(args.preset, base.layers, engine, args.rows, args.seq_len, kw)
    # device: the machine that ran the plan (a CPU); machine: the one planned for
    result = {**results_header(args.out, __file__), "kind": "plan (not measured)",
              "machine": {"host_gib": args.host_gib, "gpu_gib": args.gpu_gib, "gpu_fraction": args.gpu_fraction},
              "mode": args.mode, "engine": dataclasses.asdict(engine), "tokens_per_step": args.rows * args.seq_len,
              "preset": args.preset, "largest": tried.get(lo), "preset_as_published": same,
              "runs": [tried[n] for n in sorted(tried)]}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"largest": result["largest"], "preset_as_published": same}, indent=1))


if __name__ == "__main__":
    main()
