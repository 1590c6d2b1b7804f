"""What the plan and the step-time model predict for the rows waiting for a GPU, in one results file (CPU only):

- issue 51's scale rows: Qwen2.5-32B on one H200 of a 2-GPU host (240 GiB, 32 cores) and Llama-3-70B on one H200
  of a 4-GPU host (480 GiB, 64 cores), 8-bit moments, 32K tokens a step, the fastest layout that fits
  (``plan.layout.fastest``): the step, what bounds it, each queue's busy seconds, model TFLOP/s;
- ``l40s_sft_14b`` on one H200 of the 2-GPU host capped as its measured run was (45.6 GiB of GPU, 240 GiB of
  host), its step at the host update's rate scaled to 32 cores and at the 16-core host's own rate;
- bench.py's ``13b_8k`` on one H200 of the 2-GPU host: the layouts that ran and the search's pick (resident blocks'
  compute copies kept or cast, ``engine.resident_copy``; blocks updated on the GPU, ``gpu_updated_layers``), and
  its pick without blocks updated on the GPU;
- bench.py's ``13b_32k`` there: the layout that ran at d827385 and the search's pick;
- bench.py's 3.5B rows with nothing resident on one H200 of the 16- and the 32-core host, with and without blocks
  updated on the GPU;
- ``rtx4090_sft_8b`` on a 24 GB card with 64 GB of host: each option ``plan`` offers (``plan.levers.options``),
  its host and GPU totals, and its step on an RTX 4090 (rates from the card's specifications).

    PYTHONPATH=. python experiments/studies/plan_predictions.py \
        --out experiments/results/cpu_plan_predictions_<sha>.json

Shipped configs that name a Hugging Face folder are planned with the preset of their ``# plan shape:`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tomllib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # child.py

from child import results_header  # noqa: E402
from megatrain_jax import EngineConfig, preset  # noqa: E402
from megatrain_jax.cli.run_config import parse_config  # noqa: E402
from megatrain_jax.flops import model_flops_per_token  # noqa: E402
from megatrain_jax.plan.counts import GiB  # noqa: E402
from megatrain_jax.plan.layout import fastest  # noqa: E402
from megatrain_jax.plan.levers import options  # noqa: E402
from megatrain_jax.plan.machine import GPU_FRAGMENTATION_MARGIN  # noqa: E402
from megatrain_jax.plan.memory import plan  # noqa: E402
from megatrain_jax.plan.speeds import for_gpu  # noqa: E402
from megatrain_jax.plan.step_time import predict  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 2048
XLA_SHARE = 0.95  # what XLA takes of a GPU by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
H200_GIB = 139.8


def _step(cfg, e, rows, s) -> dict:
    t = predict(cfg, e, rows, SEQ, s)
    fpt = model_flops_per_token(cfg.active_param_count(), cfg.layers, cfg.hidden, SEQ)
    return {"seconds": round(t.seconds, 3), "bound": t.bound, "busy": {k: round(v, 3) for k, v in t.busy.items()},
            "tokens_per_s": round(rows * SEQ / t.seconds, 1),
            "model_tflops": round(rows * SEQ / t.seconds * fpt / 1e12, 1), "speeds": s.name,
            "h2d_gb": round(t.h2d_bytes / 1e9, 1), "d2h_gb": round(t.d2h_bytes / 1e9, 1),
            "resident_share": round(t.resident_share, 4)}


def scale_rows() -> list[dict]:
    out = []
    for name, host_gib, cores in (("qwen2.5-32b", 240, 32), ("llama3-70b", 480, 64)):
        cfg, rows = preset(name), 16
        e = EngineConfig(micro_batches=1, prefetch_depth=1, resident_layers="auto", kept_layers="auto",
                         master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16")
        s = for_gpu("H200", None, cores)
        best, said = fastest(cfg, e, rows, SEQ, s, host_ram_bytes=host_gib * GiB,
                             gpu_bytes=int(H200_GIB * XLA_SHARE * GiB))
        run = {"system": "plan", "config": f"{name}_q8_32k", "host_gib": host_gib, "host_cores": cores,
               "resident_layers": best.resident_layers, "kept_layers": best.kept_layers, "picked": said}
        if isinstance(best.resident_layers, int):
            run["predicted_step"] = _step(cfg, best, rows, s)
        out.append(run)
    return out


def _layout(c) -> dict:
    """An engine config's layout counts, as the rows record them."""
    return {"resident_layers": c.resident_layers, "kept_layers": c.kept_layers, "resident_copy": c.resident_copy,
            "gpu_updated_layers": c.gpu_updated_layers}


def thirteen_b_8k_on_x2() -> dict:
    """bench.py's ``13b_8k`` on one H200 of the 2-GPU host (its 32-core host's rates, the GPU memory XLA had in
    the measured run, h200x2_side_by_side_13b_8k_fcba712.json): the layout that ran (20 resident with their
    compute copies kept, the last 20 keeping products) and the search's pick with ``resident_copy`` "auto"."""
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    from bench import CONFIGS  # noqa: E402
    bench = CONFIGS["13b_8k"]
    cfg, e, rows, s = preset(bench.preset), bench.engine, bench.rows, for_gpu("H200", None, 32)
    kw = dict(host_ram_bytes=240 * GiB, gpu_bytes=int(126.4 * GiB))
    ran = dataclasses.replace(e, resident_layers=20, kept_layers=20, resident_copy=True, gpu_updated_layers=0)
    # the run of h200x2_13b_8k_gpu_updated_a0efdd0.json: 21 resident (copies cast), 4 updated on the GPU, 31 kept
    ran_g = dataclasses.replace(e, resident_layers=21, kept_layers=31, resident_copy=False, gpu_updated_layers=4)
    picked, said = fastest(cfg, e, rows, SEQ, s, **kw)
    host, host_said = fastest(cfg, dataclasses.replace(e, gpu_updated_layers=0), rows, SEQ, s, **kw)
    return {"system": "plan", "config": "13b_8k_h200x2", "gpu_gib": 126.4, "host_gib": 240, "host_cores": 32,
            "as_run_fcba712": {**_layout(ran), "predicted_step": _step(cfg, ran, rows, s)},
            "as_run_a0efdd0": {**_layout(ran_g), "predicted_step": _step(cfg, ran_g, rows, s)},
            "picked_without_gpu_updated": {**_layout(host), "said": host_said,
                                           "predicted_step": _step(cfg, host, rows, s)},
            "picked": {**_layout(picked), "said": said, "predicted_step": _step(cfg, picked, rows, s)}}


def thirteen_b_32k_on_x2() -> dict:
    """bench.py's ``13b_32k`` on one H200 of the 2-GPU host (32-core rates, the 126.4 GiB XLA had there): the layout
    that ran at d827385 (h200x2_side_by_side_13b_d827385.json: 5 resident, the last 21 keeping products) and the
    search's pick as the config runs now."""
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    from bench import CONFIGS  # noqa: E402
    bench = CONFIGS["13b_32k"]
    cfg, e, rows, s = preset(bench.preset), bench.engine, bench.rows, for_gpu("H200", None, 32)
    ran = dataclasses.replace(e, resident_layers=5, kept_layers=21, gpu_updated_layers=0)
    picked, said = fastest(cfg, e, rows, SEQ, s, host_ram_bytes=240 * GiB, gpu_bytes=int(126.4 * GiB))
    return {"system": "plan", "config": "13b_32k_h200x2", "gpu_gib": 126.4, "host_gib": 240, "host_cores": 32,
            "as_run_d827385": {**_layout(ran), "predicted_step": _step(cfg, ran, rows, s)},
            "picked": {**_layout(picked), "said": said, "predicted_step": _step(cfg, picked, rows, s)}}


def streamed_3p5b() -> list[dict]:
    """bench.py's 3.5B rows with nothing resident (8K and 32K tokens) on one H200 of the 16-core host (125.9 GiB,
    118 of it for the run) and of the 32-core one: the search's pick with blocks updated on the GPU
    (``gpu_updated_layers`` "auto", as the rows run now) and without (``*_host_updated``)."""
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    from bench import CONFIGS  # noqa: E402
    out = []
    for name in ("3p5b_8k_nothing_resident", "3p5b_32k_nothing_resident"):
        bench = CONFIGS[name]
        cfg = preset(bench.preset, layers=bench.layers)
        for cores, host_gib in ((16, 118), (32, 240)):
            s = for_gpu("H200", None, cores)
            kw = dict(host_ram_bytes=host_gib * GiB, gpu_bytes=int(H200_GIB * XLA_SHARE * GiB))
            run = {"system": "plan", "config": f"{name}_{cores}_cores", "host_gib": host_gib, "host_cores": cores}
            for key, g in (("picked", "auto"), ("picked_without_gpu_updated", 0)):
                e, said = fastest(cfg, dataclasses.replace(bench.engine, gpu_updated_layers=g), bench.rows, SEQ, s,
                                  **kw)
                run[key] = {"kept_layers": e.kept_layers, "gpu_updated_layers": e.gpu_updated_layers, "said": said,
                            "predicted_step": _step(cfg, e, bench.rows, s)}
            out.append(run)
    return out


def _shipped(name: str):
    """A shipped config's RunConfig, its HF folder replaced by the preset of its ``# plan shape:`` line."""
    path = os.path.join(REPO, "experiments", "configs", f"{name}.toml")
    text = open(path).read()
    raw = tomllib.loads(text)
    shape = re.search(r"^# plan shape: (\S+)$", text, re.MULTILINE)
    if shape:
        raw["model"] = {k: v for k, v in raw["model"].items() if k != "hf_checkpoint"} | {"preset": shape[1]}
    return parse_config(raw, path)


def l40s_on_x2() -> dict:
    rc = _shipped("l40s_sft_14b")
    cfg, d = rc.model.build(), rc.data
    e = dataclasses.replace(rc.engine, resident_layers=0, kept_layers=0)
    p = plan(cfg, e, d.batch_size, d.seq_len, detect=False, host_ram_bytes=240 * GiB,
             gpu_bytes=int(H200_GIB * 0.326 * GiB), packed=d.mode == "packed", export=True)
    return {"system": "plan", "config": "l40s_sft_14b_capped_h200x2", "host_gib": round(p.host_total / GiB, 1),
            "gpu_gib": round(p.gpu_total / GiB, 1),
            "predicted_step_32_cores": _step(cfg, e, d.batch_size, for_gpu("H200", None, 32)),
            "predicted_step_16_cores": _step(cfg, e, d.batch_size, for_gpu("H200", None, 16))}


def rtx4090_on_64() -> dict:
    rc = _shipped("rtx4090_sft_8b")
    cfg, d = rc.model.build(), rc.data
    e = dataclasses.replace(rc.engine, resident_layers=0, kept_layers=0)
    p = plan(cfg, e, d.batch_size, d.seq_len, detect=False, host_ram_bytes=64 * GiB,
             gpu_bytes=int(24 * XLA_SHARE * GiB), packed=d.mode == "packed", export=True)
    s = for_gpu("RTX 4090", None, None)
    offered = []
    for o in options(p, rc.engine):
        q = p.applied(o.changes)
        row = {"overrides": o.overrides, "host_gib": round(q.host_total / GiB, 1),
               "gpu_gib": round(q.gpu_total / GiB, 1), "gpu_available_gib": round(q.gpu_available / GiB, 1),
               "gpu_short_mib": max(0, math.ceil((q.gpu_total + GPU_FRAGMENTATION_MARGIN - q.gpu_available)
                                                 / 2**20)),
               "fits": q.fits}
        if not any(k == "model.layers" for k, _ in o.changes):
            row["predicted_step_rtx4090"] = _step(cfg, q.engine_cfg, d.batch_size, s)
        offered.append(row)
    alone = {}
    for name, switch in (("q8", (("engine.moment_dtype", "q8"), ("engine.host_grad_dtype", "bfloat16"))),
                         ("m7v5", (("engine.moment_dtype", "m7v5"), ("engine.host_grad_dtype", "bfloat16")))):
        q = p.applied(switch)  # the mode alone, without a GPU lever
        alone[name] = {"host_gib": round(q.host_total / GiB, 1), "host_fits": q.host_fits, "gpu_fits": q.gpu_fits,
                       "gpu_short_mib": max(0, math.ceil((q.gpu_total + GPU_FRAGMENTATION_MARGIN - q.gpu_available)
                                                     / 2**20))}
    return {"system": "plan", "config": "rtx4090_sft_8b_24gb_64gb", "fits_as_configured": p.fits,
            "host_gib_as_configured": round(p.host_total / GiB, 1), "modes_alone": alone, "options": offered}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    runs = scale_rows() + [l40s_on_x2(), rtx4090_on_64(), thirteen_b_8k_on_x2(), thirteen_b_32k_on_x2()] + streamed_3p5b()
    record = {**results_header(args.out, __file__), "runs": runs,
              "note": "predictions of the plan and the step-time model, not measurements"}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
