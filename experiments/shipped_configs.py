"""Every shipped config through ``megatrain-jax train``, as a user runs it (issue 31): for each
``experiments/configs/*.toml``, a few steps in a child process on this machine, with the planned and the
measured peaks, tokens/s and model TFLOP/s, and how it ended (the exit status and the error's last lines).

    PYTHONPATH=. python experiments/shipped_configs.py --steps 20 --out $OUT/h100_shipped_configs.json
    PYTHONPATH=. python experiments/shipped_configs.py --configs h100_sft_8b --steps 30 --out $OUT/x.json
    PYTHONPATH=. python experiments/shipped_configs.py --configs h200_7b_32k --set model.preset=32b \
        --set engine.master_dtype=bfloat16 --set engine.resident_layers=0 --set engine.resident_io=false \
        --set engine.micro_batches=2 --steps 10 --out $OUT/h200_qwen32b_capacity.json   # issue 31's 32B run

The export is off unless ``--export`` asks for it (into the run folder: each file's size is recorded). Every record
has the child's whole-process peak resident set (``process_peak_rss_gib``, the kernel's count at its exit: through
the end-of-run sync and the export too) and the caps the environment set (``caps``): a workstation's card and RAM
on a bigger machine, as issue 53's checks run them:

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.163 MEGATRAIN_HOST_RAM_GIB=120 PYTHONPATH=. python experiments/shipped_configs.py \
        --configs rtx4090_sft_8b --steps 20 --export --out $OUT/h200_capped_rtx4090_sft_8b.json

SIGTERM (a device call's own time limit through ``timeout``) stops the config in flight: it is recorded as ``cut``
with what its run folder holds, and the results file is written. A run folder copied back from a run whose results file was
never written becomes one with ``--record RUN_DIR --configs NAME --set ... --device 'NVIDIA H200'``.

A config that names a Hugging Face folder (the SFT examples) gets a random folder of the preset its
``# plan shape:`` line names and generated chat data (``studies/sft_run.py``'s stages), in ``--work``, made
once per shape. A config's target machine is its file name's prefix (``h100``, ``h200``, ``h200x4``, ``gh200``, ``rtx4090``,
``l40s``); each record says which it was (``target``) and the file's header which machine ran it (``device``). Metrics are
read from the run folder's ``metrics.jsonl``: speeds are medians from step 3 on (the first steps compile), without
the last step (as in the earlier files: see ``read_run_folder``);
the plan from its ``memory_plan.json``: on a GPU the exact plan (XLA's figures for the compiled programs)
and the CPU-side estimate, each compared with the measured peak (``gpu_plan_error``,
``gpu_estimate_error``: (plan - peak) / peak).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from child import REPO, results_header  # noqa: E402

CONFIGS = Path(REPO) / "experiments" / "configs"
SHAPE = re.compile(r"^# plan shape: (\S+)$", re.MULTILINE)
PLANNED = re.compile(r"planned memory: (?:host )?([\d.]+) GiB(?: of host RAM)?(?:, GPU ([\d.]+) GiB)?")
PARAMS = re.compile(r"^megatrain_jax: ([\d,.]+) M params", re.MULTILINE)
STATUS = {0: "ok", 2: "bad input", 3: "diverged", 4: "out of GPU memory"}


def target(path: Path) -> str:
    """The machine a config is written for, from its file name (``h100_7b_32k.toml`` -> ``h100``)."""
    prefix = path.stem.split("_")[0]
    return prefix if prefix in ("h100", "h200", "h200x4", "gh200", "rtx4090", "l40s") else "any"


def hf_inputs(path: Path, work: Path) -> list[str]:
    """The overrides that give an HF-checkpoint config a random folder of its shape and generated chats, made
    in ``work`` if they are not there yet (nothing for a config that names no folder)."""
    text = path.read_text()
    shape = SHAPE.search(text)
    if "hf_checkpoint" not in text or shape is None:
        return []
    folder = work / shape.group(1)
    if not (folder / "checkpoint" / "config.json").exists():
        generated_chats(folder, shape.group(1), fresh=True)
        _sft_stage(folder, shape.group(1), "checkpoint")
    return [f"model.hf_checkpoint={folder / 'checkpoint'}", f"data.path={folder / 'chat.jsonl'}"]


def generated_chats(folder: Path, shape: str, fresh: bool = False) -> tuple[Path, Path]:
    """The chats an HF-checkpoint config trains on here (``studies/sft_run.py``'s data stage: 4,000 generated
    conversations and the tokenizer trained on them), made in ``folder`` unless there (or ``fresh``): the JSONL
    file and the tokenizer's folder."""
    if fresh or not (folder / "checkpoint" / "tokenizer.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        _sft_stage(folder, shape, "data")
    return folder / "chat.jsonl", folder / "checkpoint"


def _sft_stage(folder: Path, shape: str, stage: str) -> None:
    subprocess.run([sys.executable, str(Path(REPO) / "experiments/studies/sft_run.py"), "--work", str(folder),
                    "--preset", shape, "--examples", "4000", "--stage", stage], cwd=REPO, check=True)


class Cut(Exception):
    """SIGTERM reached this script (e.g. a device call's own time limit, through ``timeout``)."""


@contextlib.contextmanager
def sigterm_cuts():
    """Inside, SIGTERM raises ``Cut``: the config in flight is stopped (``subprocess.run`` kills its child), recorded
    from its run folder as ``cut``, and the results file is still written."""
    def cut(signum, frame):
        raise Cut()
    previous = signal.signal(signal.SIGTERM, cut)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_child(cmd: list[str], env: dict, timeout: float | None) -> tuple[int | str | None, str, float]:
    """``cmd`` in a child process: its exit code (None when ``timeout`` killed it, ``"cut"`` when ``Cut`` did),
    its output, and its peak resident set in GiB, from the kernel's accounting at its exit (``wait4``): the
    whole process's peak, through training, the end-of-run sync and the export, not only the steps' samples.
    Whatever ends the wait, the child is killed (if still running) and reaped here before this returns."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        code: int | str | None = None
        usage = None
        try:
            while usage is None:
                pid, status, got = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    code, usage = os.waitstatus_to_exitcode(status), got
                elif deadline is not None and time.monotonic() > deadline:
                    usage = _kill_and_reap(proc.pid)  # code stays None: the timeout's
                else:
                    time.sleep(0.2)
        except Cut:
            code, usage = "cut", _kill_and_reap(proc.pid)
        finally:
            if usage is None:  # another exception: the child must not outlive this script unreaped
                _kill_and_reap(proc.pid)
            proc.returncode = code if isinstance(code, int) else -9  # reaped here: Popen must not wait for it
        log.seek(0)
        return code, log.read(), usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def _kill_and_reap(pid: int):
    """SIGKILL to a child this script has not reaped (its pid cannot be reused before that), then its usage. Not
    ``Popen.kill``, which may reap it first and leave ``wait4`` nothing to wait for."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return os.wait4(pid, 0)[2]


def run_config(path: Path, steps: int, work: Path, timeout: float | None, extra: list[str] = (),
               export: bool = False) -> dict:
    """One config through ``python -m megatrain_jax train`` for ``steps`` steps; its record (status ``cut``
    when ``Cut`` stopped it: what its run folder holds by then). With ``export`` the config's Hugging Face export
    is written (into the run folder) and recorded; otherwise it is turned off."""
    run_dir = work / "runs" / path.stem
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [*hf_inputs(path, work), f"train.steps={steps}", "train.log_every=1", "train.eval_every=0",
                 f"train.run_dir={run_dir}", f"train.export_hf={run_dir / 'hf' if export else 'none'}", *extra]
    cmd = [sys.executable, "-m", "megatrain_jax", "train", "--config", str(path), *overrides]
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    limits = caps()  # read before the run: a bad value must not lose the record after it
    t = time.perf_counter()
    code, output, process_peak = run_child(cmd, env, timeout)
    status = {None: "timeout", "cut": "cut"}.get(code) or STATUS.get(code, f"error: exit {code}")
    record = {"config": path.stem, "target": target(path), "overrides": overrides,
              "wall_s": round(time.perf_counter() - t, 1), "exit_status": code if isinstance(code, int) else None,
              "status": status, "process_peak_rss_gib": round(process_peak, 3), "caps": limits}
    if export:
        record["export"] = export_record(run_dir / "hf")
        if status == "ok" and not record["export"]["safetensors"]:
            record["status"] = "error: no export written"
    params = PARAMS.search(output)
    if params:
        record["params"] = round(float(params.group(1).replace(",", "")) * 1e6)
        if status == "ok":  # the whole run's peak over the parameters (issue 52's bar: host bytes a parameter)
            record["process_bytes_per_param"] = round(process_peak * 2**30 / record["params"], 2)
    planned = PLANNED.search(output)
    if planned:
        record["planned"] = {"host_gib": float(planned.group(1)),
                             "gpu_gib": None if planned.group(2) is None else float(planned.group(2))}
    read_run_folder(run_dir, record)
    if record["status"] != "ok":
        record["error_tail"] = [line[:300] for line in output.strip().splitlines()[-12:]]
    return record


def caps() -> dict:
    """The limits this run was given by the environment (a workstation's memory on a bigger machine): the share of
    the GPU XLA may take and the host RAM the plan may count, when set."""
    def value(name: str) -> float | str | None:
        text = os.environ.get(name, "").strip()
        try:
            return float(text) if text else None  # empty: unset, as megatrain_jax reads it
        except ValueError:
            return text  # as given: the run says what is wrong with it
    return {"xla_mem_fraction": value("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "host_ram_gib": value("MEGATRAIN_HOST_RAM_GIB")}


def export_record(folder: Path) -> dict:
    """What a run's Hugging Face export folder holds: each file's size, and the weights' bytes."""
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file()} if folder.is_dir() else {}
    weights = [n for n in files if n.endswith(".safetensors")]
    return {"folder": str(folder), "files": files, "safetensors": len(weights),
            "weights_bytes": sum(files[n] for n in weights)}


def read_run_folder(run_dir: Path, record: dict) -> None:
    """Into ``record``: the plan ``train`` wrote in ``run_dir`` and what its ``metrics.jsonl`` measured (speeds,
    peaks against the plan, every loss)."""
    if (run_dir / "memory_plan.json").exists():  # the plan the run started with, as train wrote it
        memory = json.loads((run_dir / "memory_plan.json").read_text())
        gib = lambda b: None if b is None else round(b / 2**30, 3)  # noqa: E731
        record["planned"] = {"host_gib": gib(memory["host_total"]), "gpu_gib": gib(memory["gpu_total"]),
                             "gpu_exact": memory["gpu_exact"], "gpu_estimate_gib": gib(memory["estimate_gpu_total"]),
                             "gpu_available_gib": gib(memory["gpu_available"]), "gpu_peak_at": memory["gpu_peak_at"],
                             "engine": memory["engine"], "predicted_step": memory.get("predicted_step"),
                             "programs": None if memory["programs"] is None else
                             [{k: (gib(v) if isinstance(v, int) else v) for k, v in f.items()}
                              for f in memory["programs"]["programs"]]}
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    if rows:
        # From step 3 on (the first steps compile), without the last: until c44873b the engine's step times were
        # the gaps between successive reads of the steps' results, and the last read followed the one before
        # closely (70B on one H200: 5.7 s against 22 s for the others); now each is the gap between the steps'
        # results on the device (engine/step_clock.py), and the last is still left out so that speeds compare
        # with the earlier files.
        timed = [r for r in rows[:-1] if r["step"] >= 3] or [r for r in rows if r["step"] >= 3] or rows
        # a step profiled with `--set train.profile_step=N` ran serialized, and the next one started from an idle
        # GPU: neither is timed; the profiled step's lanes are kept beside the plan's busy seconds per lane
        profiled = {r["step"] for r in rows if r.get("profiled")}
        unprofiled = [r for r in timed if r["step"] not in profiled and r["step"] - 1 not in profiled]
        if profiled and not unprofiled:
            record["timing_includes_profiled_step"] = True  # too few steps to leave it out
        timed = unprofiled or timed
        # the evaluation after a step (train.eval_every) runs before the next step starts: that step is not timed
        evaluated = {r["step"] for r in rows if "eval_loss" in r}
        timed = [r for r in timed if r["step"] - 1 not in evaluated] or timed
        record.update(steps_reported=len(rows), loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"],
                      tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in timed), 1),
                      model_tflops=round(statistics.median(r["model_tflops"] for r in timed), 1),
                      gpu_peak_gib=max((r.get("gpu_peak_gib") or 0) for r in rows) or None,
                      host_peak_gib=max((r.get("host_peak_rss_gib") or 0) for r in rows) or None,
                      # the resident set by kind at the step ends: its own arrays, and mapped files
                      host_anon_max_gib=max((r.get("host_rss_anon_gib") or 0) for r in rows) or None,
                      host_file_max_gib=max((r.get("host_rss_file_gib") or 0) for r in rows) or None,
                      losses=[round(r["loss"], 5) for r in rows],
                      step_times_s=[round(r["step_time_s"], 3) for r in rows if "step_time_s" in r])
        if all("loss_tokens_per_s" in r for r in timed):  # the tokens in the loss (padding, prompts left out)
            record["loss_tokens_per_s"] = round(statistics.median(r["loss_tokens_per_s"] for r in timed), 1)
        if evaluated:  # the held-out loss after each evaluated step
            record["eval_losses"] = {str(r["step"]): round(r["eval_loss"], 5) for r in rows if "eval_loss" in r}
        if "lm_loss" in rows[0]:  # a routed model: the next-token and load-balancing terms of each loss
            record.update(lm_losses=[round(r["lm_loss"], 5) for r in rows],
                          aux_losses=[round(r["aux_loss"], 5) for r in rows])
        planned = record.get("planned") or {}
        times = [r["step_time_s"] for r in timed if "step_time_s" in r]
        predicted = planned.get("predicted_step")
        if times:
            record["step_time_s"] = round(statistics.median(times), 4)
        if times and predicted:  # the step-time model (plan.step_time) against the median measured step
            record["step_time_error"] = round((predicted["seconds"] - record["step_time_s"]) / record["step_time_s"], 4)
        for r in rows:
            if r.get("profiled"):
                record["profile"] = {"step": r["step"], **{k.removeprefix("profile_"): round(v, 4) for k, v in r.items()
                                                           if k.startswith("profile_")},
                                     "plan_busy": (predicted or {}).get("busy")}
        for side in ("host", "gpu"):
            plan, peak = planned.get(f"{side}_gib"), record.get(f"{side}_peak_gib")
            if plan and peak:
                record[f"{side}_plan_error"] = round((plan - peak) / peak, 4)
        if planned.get("gpu_estimate_gib") and record.get("gpu_peak_gib"):  # the CPU-side estimate's errors
            record["gpu_estimate_error"] = round((planned["gpu_estimate_gib"] - record["gpu_peak_gib"])
                                                 / record["gpu_peak_gib"], 4)
            record["gpu_estimate_vs_exact"] = round((planned["gpu_estimate_gib"] - planned["gpu_gib"])
                                                    / planned["gpu_gib"], 4)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=None, help="comma-separated config names (default: every shipped one)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--work", default="/tmp/shipped_configs", help="run folders and generated checkpoints")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per config")
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value",
                    help="an override for every selected config (repeatable), e.g. the 32B capacity command")
    ap.add_argument("--record", metavar="RUN_DIR", help="no run: the record of a run folder copied back from a run "
                                                        "whose own results file was never written (one --configs, "
                                                        "with the --set it ran with, and --device)")
    ap.add_argument("--device", help="with --record: the GPU the run folder comes from (e.g. 'NVIDIA H200')")
    ap.add_argument("--export", action="store_true",
                    help="write each config's Hugging Face export (into its run folder) and record its files; "
                         "the whole process's peak is recorded either way")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.record:
        return record_folder(ap, args)
    paths = sorted(CONFIGS.glob("*.toml"))
    if args.configs:
        wanted = args.configs.split(",")
        unknown = sorted(set(wanted) - {p.stem for p in paths})
        if unknown:
            ap.error(f"unknown configs {unknown}; shipped: {[p.stem for p in paths]}")
        paths = [p for p in paths if p.stem in wanted]
    work = Path(args.work)
    runs = []
    with sigterm_cuts():
        for path in paths:
            try:
                runs.append(run_config(path, args.steps, work, args.timeout, args.set, export=args.export))
            except Cut:  # outside the train child (making an SFT config's inputs, reading its run folder)
                runs.append({"config": path.stem, "target": target(path), "exit_status": None, "status": "cut",
                             "note": "SIGTERM while this script prepared or read the run, not during train"})
            print(json.dumps({k: runs[-1].get(k) for k in ("config", "status", "planned", "gpu_peak_gib",
                                                            "host_peak_gib", "process_peak_rss_gib", "tokens_per_s",
                                                            "model_tflops")}), flush=True)
            try:
                write_json(Path(args.out), {"name": Path(args.out).stem, "runs": runs})
            except Cut:
                pass  # the final write below follows
            if runs[-1]["status"] == "cut":
                break  # the configs after it are not run
    result = {**results_header(args.out, __file__), "runs": runs}
    write_json(Path(args.out), result)
    return result


def record_folder(ap: argparse.ArgumentParser, args) -> dict:
    """``--record``: the results file of a run folder copied back after its run was cut before this script wrote
    one; the device is the one named (not this machine), the commit ``MEGATRAIN_GIT_COMMIT`` or this checkout's."""
    if not args.configs or "," in args.configs or not args.device:
        ap.error("--record takes one --configs (the config the run used) and --device (the GPU it ran on)")
    path = CONFIGS / f"{args.configs}.toml"
    record = {"config": path.stem, "target": target(path), "overrides": args.set, "exit_status": None,
              "status": "cut", "note": f"recorded from the run folder {args.record} after the run was cut"}
    read_run_folder(Path(args.record), record)
    header = results_header(args.out, __file__)
    result = {**header, "device": {"name": args.device, "platform": "gpu", "recorded_on": header["device"]},
              "runs": [record]}
    write_json(Path(args.out), result)
    return result


def write_json(path: Path, obj: dict) -> None:
    """``obj`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
