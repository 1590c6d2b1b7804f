"""The step-time model (``megatrain_jax.plan.step_time``) against every measured run committed with its whole
layout: each run's predicted step time beside the measured one, per GPU kind, with the rates of
``megatrain_jax.plan.speeds`` (or a calibration file). CPU only; reads the results files, runs nothing.

    PYTHONPATH=. python experiments/step_time_vs_runs.py --out experiments/results/cpu_step_time_vs_runs.json

A run qualifies where its record holds the model's shape (``model``), the engine config as run (``engine``, a
number of resident blocks), ``seq_len``, ``tokens_per_step`` and a measured ``step_time_s`` (bench.py,
side_by_side.py, scaling.py, capacity.py, long_context.py, scale_projection.py), on a GPU kind ``speeds``
knows; each on its host's cores (``Speeds.on_host``, from the file's ``device.cpu_cores``). The records of
``shipped_configs.py`` (a shipped config through ``megatrain-jax train``) qualify too, read back through the config
and their overrides with the engine ``train`` ran, where they timed at least 3 steps. The model's family
is the preset of the same block shape (hidden, ffn, heads, kv heads; MoE runs are
left out: their records lack the experts). ``--fit`` searches the rates that bring the median error closest to
0 and the spread down (coordinate search on a log scale), per GPU kind, and prints them: the values
``speeds.SPEEDS`` holds came from it. A run that timed the host update at its start and recorded it
(``predicted_step.host_measured``, since 249dd3f; the runs at 117fbab name the rate only in ``speeds``) is
predicted with those rates, as ``train`` predicted it (``Speeds.measured_here``), unless a calibration file is
given. What the rows held (``RowMix``: packed rows attend within their runs, documents and each row's padding;
the backward over tokens no loss reaches runs faster): a run is predicted with what its record gives
(``predicted_step.attention_span`` and ``no_gradient``); with ``--work`` (the study's own command: the file it
writes), a shipped config's run on the chats ``shipped_configs.py`` generated (``shipped_configs.generated_chats``,
made once in that folder) with theirs, read as ``train`` makes the rows; without it (the tests), as recorded. A
bench.py run of packed rows is predicted at ``BenchConfig.row_mix``. (The ``document_len`` of the runs at e20d02d
and 803ad8b left the padding out, and ec4ee5c's ``out_of_loss`` counted the prompts: neither is read.) Reported
apart with the runs before ``SINCE`` ("older"): runs of engine code since taken back or replaced (``TAKEN_BACK``), a
study of repeats (``REPEATS``), and runs whose host timed its update under ``SLOW_HOST`` of what the measured host
of its kind nearest in cores timed (``slow_host``: another process was using the host, and ``train`` says so beside its prediction). The runs at
a6e8da5 to d93059a timed capacity mode and the quantized modes as the fastest of five short calls, which reads
~16% above the sustained timing since e6a0fc5 (NOTES, 2026-12-01); they are predicted with the same in-step share.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatrain_jax.batch import RowMix  # noqa: E402
from megatrain_jax.cli import load_config  # noqa: E402
from megatrain_jax.engine.config import EngineConfig  # noqa: E402
from megatrain_jax.engine.precision import REMOVED_MOMENT_DTYPES  # noqa: E402
from megatrain_jax.models import PRESETS, preset  # noqa: E402
from megatrain_jax.plan import speeds as speeds_mod  # noqa: E402
from megatrain_jax.plan import step_time  # noqa: E402
from megatrain_jax.plan.step_time import predict  # noqa: E402

import bench  # noqa: E402  (experiments/: its packed rows)
import shipped_configs  # noqa: E402  (experiments/: the chats a shipped config's run trained on)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
FITTED = ("matmul_flops", "attention_flops", "attention_backward", "kept_backward", "h2d_bytes", "link_bytes",
          "hbm_bytes", "disk_bytes", "host_full", "host_lean", "host_capacity", "host_q8")
# The engine as it runs now: runs before this date ran an engine since made faster (pacing, split updates,
# kept layers), which the model does not describe; they are reported apart ("older").
SINCE = "2026-11-25"
# Runs of engine code since taken back (experiments/studies/NOTES.md: the first form of blocks updated on the GPU,
# 158a849 to b97e9c4, each block's record on the GPU from its update to its next forward): reported apart too.
# So is the two-pass step's first form, with two forwards a step (8a19123), since run with one forward (d61709d;
# NOTES, "The two-pass step with one forward": the same config at 1e2781e is h200_21b_*_two_pass_cli_1e2781e.json).
TAKEN_BACK = ("h200_side_by_side_gpu_updated_13c9b71.json", "h200_side_by_side_gpu_updated_b97e9c4.json",
              "h200_21b_q8_two_pass_cli_8a19123.json")
# A study of the spread between repeats, reported apart too (with the "older" runs): two rows alternated twice in
# one process (experiments/studies/NOTES.md, 2026-11-30), the first after the process's start ran 1.131 s against
# 0.964 s for the same row later in the same process; it measured the machine's spread, not a step.
REPEATS = ("h200x2_3p5b_8k_split_count_order_b439b4d.json",)
# A bench run with one timed step after one warm-up step may time programs compiled at their first use (a block
# updated on the GPU compiles its update at the second step: h200x2_13b_32k_pool_abfe3c3.json, 8.2 s against
# 5.0 steady): such runs are left out.
MIN_TIMED = 2
WORK = os.path.join(REPO, "build", "step_time_vs_runs")  # --work's default: the generated chats, made once
_MIXES: dict[tuple, RowMix | None] = {}  # the generated chats' rows, per (folder, shape, data settings), read once


def _removed_mode(engine: dict, overrides: list[str] = ()) -> bool:
    """Whether a run trained in a precision mode since removed (4-bit moments, m8v4: ``REMOVED_MOMENT_DTYPES``),
    which no config takes now: such runs are left out."""
    return engine.get("moment_dtype") in REMOVED_MOMENT_DTYPES or any(
        o.split("=", 1) == ["engine.moment_dtype", d] for o in overrides for d in REMOVED_MOMENT_DTYPES)


def _shape_preset(model: dict) -> str | None:
    for name in PRESETS:
        c = preset(name)
        if c.moe is None and (c.hidden, c.ffn, c.heads, c.kv_heads) == (model["hidden"], model["ffn"], model["heads"],
                                                                         model["kv_heads"]):
            return name
    return None


def runs(since: str = SINCE, work: str | None = None) -> list[dict]:
    """The qualifying runs: file, run, GPU kind, model config, engine config, rows, seq_len, measured seconds."""
    out = []
    files = sorted(glob.glob(f"{REPO}/experiments/results/*.json")) + \
        sorted(glob.glob(f"{REPO}/tests/assets/measured/*.json"))
    for path in files:
        try:
            d = json.load(open(path))
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(d, dict) or not isinstance(d.get("runs"), list):
            continue
        date = str(d.get("date") or "")
        older = date < since or os.path.basename(path) in TAKEN_BACK + REPEATS
        dev = d.get("device")
        name = dev.get("name") if isinstance(dev, dict) else dev
        if not name:  # a header written before its GPU was named: the GPU its runs name, where they agree
            named = {r.get("device") for r in d["runs"] if isinstance(r, dict) and isinstance(r.get("device"), str)}
            name = named.pop() if len(named) == 1 else None
        kind = speeds_mod.kind_of(name if isinstance(name, str) else None)
        cores = dev.get("cpu_cores") if isinstance(dev, dict) else None
        for i, r in enumerate(d["runs"]):
            shipped = _shipped_config_run(r) if kind is not None else None
            if shipped is not None:  # a `megatrain-jax train` run of a shipped config (shipped_configs.py)
                generated = shipped.pop("generated")
                out.append({"file": os.path.relpath(path, REPO), "date": date, "older": older,
                            "run": r["config"], "kind": kind, "host_cores": cores,
                            "host_measured": _host_measured((r.get("planned") or {}).get("predicted_step")),
                            **shipped, "mix": _row_mix((r.get("planned") or {}).get("predicted_step"), generated,
                                                       work)})
                continue
            if not (isinstance(r, dict) and r.get("system") == "megatrain_jax" and r.get("status") == "ok"
                    and isinstance(r.get("engine"), dict) and isinstance(r.get("model"), dict)
                    and r.get("step_time_s") and r.get("seq_len") and r.get("tokens_per_step")
                    and r.get("steps_timed", MIN_TIMED) >= MIN_TIMED):
                continue
            engine = {k: v for k, v in r["engine"].items() if k in ENGINE_FIELDS}
            if not isinstance(engine.get("resident_layers", 0), int) or kind is None or _removed_mode(engine):
                continue
            shape = _shape_preset(r["model"])
            if shape is None or r.get("model", {}).get("active_params"):
                continue
            cfg = preset(shape, layers=r["model"]["layers"], vocab_size=r["model"]["vocab"])
            gpus = r.get("num_gpus") or 1
            out.append({"file": os.path.relpath(path, REPO), "date": date, "older": older,
                        "run": r.get("config", str(i)), "kind": kind,
                        "gpus": gpus, "host_cores": cores, "cfg": cfg, "shape": shape, "engine": EngineConfig(**engine),
                        "rows": r["tokens_per_step"] // r["seq_len"], "seq_len": r["seq_len"],
                        "measured_s": r["step_time_s"], "host_measured": _host_measured(r.get("predicted_step")),
                        "mix": _row_mix(r.get("predicted_step")) or _bench_mix(r, shape)})
    for r in out:  # a run whose host timed itself far under its kind's usual rate is reported apart, as `train`
        # notes it (step_time.slow_host; NOTES, 2026-12-01: one H200 loan timed 1.61 G params/s against 3.00)
        if step_time.slow_host(r["kind"], r["host_cores"], r.get("host_measured")) is not None:
            r["older"] = r["slow_host"] = True
    return out


def _bench_mix(r: dict, shape: str) -> RowMix | None:
    """A bench.py run of packed rows (``packed_docs_per_row`` documents cut at random in each): their span as
    ``BenchConfig.row_mix`` counts it, every token in the loss; None for whole rows."""
    docs = r.get("packed_docs_per_row")
    if not docs:
        return None
    return bench.BenchConfig(shape, r["model"]["layers"], r["seq_len"], r["tokens_per_step"] // r["seq_len"],
                             EngineConfig(), packed_docs=docs).row_mix()


def _row_mix(predicted, generated: tuple | None = None, work: str | None = None) -> RowMix | None:
    """What the rows held: with ``work``, the chats a shipped config's run trained on, read as ``train`` makes the
    rows (``generated``: their shape, the data section and the model; made in ``work``); else as the run's
    prediction counted it (its record's ``predicted_step.attention_span`` and ``no_gradient``, each recorded where
    it applied); None: whole rows, every token in the loss."""
    if generated is not None and work is not None:
        shape, data, model = generated
        pieces = model.segments_per_row(data.seq_len) - 1 if data.mode == "packed" else None
        key = (work, shape, data.mode, data.seq_len, data.too_long, data.eval_fraction, data.seed, pieces)
        if key not in _MIXES:
            chats, tokenizer = shipped_configs.generated_chats(Path(work) / shape, shape)
            read = dataclasses.replace(data, path=str(chats), tokenizer=str(tokenizer),
                                       cache_dir=str(Path(work) / "cache"))
            _MIXES[key] = read.row_mix(model.vocab_size, pieces)
        return _MIXES[key]
    if not isinstance(predicted, dict) or not (predicted.get("attention_span") or predicted.get("no_gradient")):
        return None
    span = predicted.get("attention_span")
    return RowMix(None if span is None else float(span), float(predicted.get("no_gradient") or 0.0))


def _host_measured(predicted) -> dict | None:
    """The host update a run timed on its host at its start (its record's ``predicted_step.host_measured``, since
    249dd3f), which the model is given again; None for runs before it."""
    got = predicted.get("host_measured") if isinstance(predicted, dict) else None
    return got if isinstance(got, dict) else None


def _speeds_for(r: dict, s: speeds_mod.Speeds, measured: bool = True) -> speeds_mod.Speeds:
    """``s`` on the run's host: its cores (``Speeds.on_host``), then the host update it timed at its start where
    it did (``Speeds.measured_here``, as ``train`` predicts), unless ``measured`` is off (a calibration file given,
    which wins there too)."""
    h = s.on_host(r["host_cores"])
    return h.measured_here(r["host_measured"], r["host_cores"]) if measured and r.get("host_measured") else h


def _shipped_config_run(r) -> dict | None:
    """A record of experiments/shipped_configs.py (a shipped config through ``megatrain-jax train``, its overrides
    and the engine ``train`` ran) as a run of the model: its config read back with those overrides (a Hugging Face
    config planned with its ``# plan shape:`` preset); None for any other record, a routed model, or a run with
    fewer than 3 timed steps (the record's median leaves out the first two steps and the last)."""
    if not (isinstance(r, dict) and r.get("status") == "ok" and r.get("step_time_s") and "overrides" in r
            and isinstance((r.get("planned") or {}).get("engine"), dict) and len(r.get("step_times_s") or []) >= 6):
        return None
    path = os.path.join(REPO, "experiments", "configs", f"{r['config']}.toml")
    if not os.path.exists(path) or _removed_mode(r["planned"]["engine"], r["overrides"]):
        return None
    overrides = [o for o in r["overrides"] if not o.startswith(("model.hf_checkpoint=", "data.path=", "train."))]
    shape = re.search(r"^# plan shape: (\S+)$", open(path).read(), re.MULTILINE)
    if shape:  # the preset the config's comment names, unless the run set one of its own (later overrides win)
        overrides = ["model.hf_checkpoint=none", f"model.preset={shape.group(1)}", *overrides]
    cfg = load_config(path, overrides)
    model = cfg.model.build()
    engine = EngineConfig(**{k: v for k, v in r["planned"]["engine"].items() if k in ENGINE_FIELDS})
    if model.moe is not None or not isinstance(engine.resident_layers, int):
        return None
    # the chats shipped_configs.py made for a packed chat config: (their shape, the data section, the model)
    generated = ((shape.group(1), cfg.data, model) if shape and cfg.data.mode == "packed"
                 and cfg.data.format == "chat" else None)
    return {"gpus": cfg.train.devices or 1, "cfg": model, "shape": r["config"], "engine": engine,
            "rows": cfg.data.batch_size, "seq_len": cfg.data.seq_len, "measured_s": r["step_time_s"],
            "generated": generated}


def _with(s: speeds_mod.Speeds, key: str, value: float) -> speeds_mod.Speeds:
    if key.startswith("host_"):
        return s.replace(host_update={**s.host_update, key[5:]: value})
    if key == "h2d_bytes":
        return s.replace(h2d_bytes=value, d2h_bytes=value)
    return s.replace(**{key: value})


def _get(s: speeds_mod.Speeds, key: str) -> float:
    return s.host_update[key[5:]] if key.startswith("host_") else getattr(s, key)


def errors(rs: list[dict], s: speeds_mod.Speeds, measured: bool = True) -> list[float]:
    out = []
    for r in rs:
        p = predict(r["cfg"], r["engine"], r["rows"], r["seq_len"], _speeds_for(r, s, measured), devices=r["gpus"],
                    mix=r["mix"])
        out.append((p.seconds - r["measured_s"]) / r["measured_s"])
    return out


def loss(errs: list[float]) -> float:
    """What the fit lowers: the mean absolute log ratio (a run 10% slow and one 10% fast weigh alike)."""
    return statistics.fmean(abs(math.log1p(e)) for e in errs)


def fit(rs: list[dict], s: speeds_mod.Speeds, rounds: int = 3, measured: bool = True) -> speeds_mod.Speeds:
    """The rates searched one at a time for the lowest ``loss``; ``measured``: runs that timed their host are
    predicted at those rates (``_speeds_for``), so the host fields are fitted to the others."""
    for _ in range(rounds):
        for key in FITTED:
            if _get(s, key) is None:  # a rate the kind does not have (a link not measured): nothing to fit
                continue
            best, best_loss = _get(s, key), loss(errors(rs, s, measured))
            for f in (0.7, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.4):
                trial = _with(s, key, _get(s, key) * f)
                trial_loss = loss(errors(rs, trial, measured))
                if trial_loss < best_loss - 1e-4:
                    best, best_loss = _get(trial, key), trial_loss
            s = _with(s, key, best)
    return s


def _summary(errs: list[float], rows: list[dict], s: speeds_mod.Speeds) -> dict:
    return {"runs": len(errs), "median_error": round(statistics.median(errs), 4),
            "median_abs_error": round(statistics.median(abs(x) for x in errs), 4),
            "within_10pct": sum(abs(x) <= 0.10 for x in errs), "within_20pct": sum(abs(x) <= 0.20 for x in errs),
            "worst": sorted(({"run": x["run"], "file": x["file"], "error": x["error"]} for x in rows),
                            key=lambda x: -abs(x["error"]))[:5], "speeds": s.name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--speeds", default=None, help="a calibration file (JSON of Speeds fields) for every kind")
    ap.add_argument("--fit", action="store_true", help="search the rates per GPU kind and print them")
    ap.add_argument("--since", default=SINCE, help="runs before this date (YYYY-MM-DD) are reported apart")
    ap.add_argument("--work", default=WORK, help="where the chats shipped configs trained on are generated, once, "
                                                 "to read their packed rows' span ('none': whole rows)")
    args = ap.parse_args()
    rs = runs(args.since, None if args.work == "none" else args.work)
    rows, summary, fitted = [], {}, {}
    for kind in sorted({r["kind"] for r in rs}):
        mine = [r for r in rs if r["kind"] == kind and not r["older"]]
        s = speeds_mod.SPEEDS[kind] if args.speeds is None else speeds_mod.from_file(args.speeds,
                                                                                    speeds_mod.SPEEDS[kind])
        if args.fit:
            s = fit(mine, s, measured=args.speeds is None)
            fitted[kind] = {k: _get(s, k) for k in FITTED if _get(s, k) is not None}
            print(kind, json.dumps(fitted[kind]), flush=True)
        for r in [r for r in rs if r["kind"] == kind]:
            p = predict(r["cfg"], r["engine"], r["rows"], r["seq_len"], _speeds_for(r, s, args.speeds is None),
                        devices=r["gpus"], mix=r["mix"])
            e = r["engine"]
            rows.append({"file": r["file"], "date": r["date"], "older": r["older"],
                         "slow_host": r.get("slow_host", False), "run": r["run"], "kind": kind,
                         "gpus": r["gpus"], "host_cores": r["host_cores"], "model": r["shape"],
                         "layers": r["cfg"].layers, "rows": r["rows"], "seq_len": r["seq_len"],
                         "layout": {"resident_layers": e.resident_layers, "resident_io": e.resident_io,
                                    "kept_layers": e.kept_layers, "micro_batches": e.micro_batches,
                                    "offload_activations": e.offload_activations, "mode": e.precision.name,
                                    "grads_on_gpu": e.grads_on_gpu, "disk_parts": e.disk_parts},
                         "host_measured": r["host_measured"],
                         "attention_span": None if r["mix"] is None else r["mix"].attention_span,
                         "no_gradient": None if r["mix"] is None else round(r["mix"].no_gradient, 4),
                         "measured_s": r["measured_s"], "predicted_s": round(p.seconds, 4),
                         "error": round((p.seconds - r["measured_s"]) / r["measured_s"], 4), "bound": p.bound,
                         "busy_s": p.busy})
        for older in (False, True):
            errs = [x["error"] for x in rows if x["kind"] == kind and x["older"] == older]
            if errs:
                summary[f"{kind}{' older' if older else ''}"] = _summary(errs, [x for x in rows if x["kind"] == kind
                                                                                and x["older"] == older], s)
        for key in (kind, f"{kind} older"):
            if key in summary:
                print(key, json.dumps({k: v for k, v in summary[key].items() if k != "worst"}), flush=True)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"name": os.path.splitext(os.path.basename(args.out))[0],
              "command": "PYTHONPATH=. python experiments/step_time_vs_runs.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "device": {"name": "CPU (reads results files)", "cpu_cores": os.cpu_count()},
              "date": datetime.date.today().isoformat(), "summary": summary,
              **({"fitted": fitted} if fitted else {}), "runs": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
