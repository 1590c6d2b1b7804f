"""``train``: a RunConfig in, a trained model and a run folder out.

Assembles the model (abstract, initialized part by part by the engine, or filled from a Hugging Face
checkpoint), the data, the optimizer and the hooks (evaluation, memory stats, metrics.jsonl, TensorBoard,
W&B, progress), then calls ``fit``. The run folder gets the resolved ``config.toml`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, TextIO

import jax
import numpy as np
from flax import nnx

from megatrain_jax import distributed
from megatrain_jax.batch import RowMix
from megatrain_jax._environment import gpu_fraction_source, gpu_fraction_var, host_pool_limit, user_host_pool_limit
from megatrain_jax.checkpoint import CorruptCheckpointError
from megatrain_jax.cli.disk_room import check_disk_room
from megatrain_jax.cli.export_guard import guarded_export
from megatrain_jax.cli.output_paths import check_output_paths
from megatrain_jax.cli.run_config import RunConfig, TrainSection, check_positions, to_dict
from megatrain_jax.cli.run_folder import prepare_run_folder, rebuild_metrics, write_config
from megatrain_jax.cli.run_lock import RunLock
from megatrain_jax.evaluate import eval_hook
from megatrain_jax.engine.out_of_memory import DeviceOutOfMemoryError
from megatrain_jax.batch import Batch
from megatrain_jax.fit import History, Hook, fit
from megatrain_jax.loss import DPO, NextToken
from megatrain_jax.hf.export_folder import check_target, tokenizer_files
from megatrain_jax.models import Decoder
from megatrain_jax.observe import JsonlWriter, Progress, TensorBoardWriter, WandbLogger, memory_hook
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.plan import (GiB, Machine, MemoryPlan, exact_plan, fit_host_pool, fitted_pool_limit, gpu_fraction,
                                options, plan, require_fit, resolve)
from megatrain_jax.plan.step_time import for_machine, machine_speeds, step_line

# The README demo: the tiny preset learns the synthetic Markov + induction corpus (megatrain_jax.data.demo)
# from ln 256 = 5.5 nats to about 1.3 in a few hundred steps, about a minute on a 2-core CPU.
# experiments/configs/demo_tiny.toml holds the same settings (a test keeps them equal).
DEMO: dict = {
    "model": {"preset": "tiny"},
    "data": {"seq_len": 128, "batch_size": 16, "eval_fraction": 0.02},
    "engine": {"micro_batches": 1, "clip_norm": 1.0},
    "optimizer": {"lr": 3e-3, "warmup_steps": 20, "decay": "cosine", "min_lr_ratio": 0.1, "weight_decay": 0.1},
    "train": {"steps": 300, "log_every": 25, "eval_every": 100, "eval_batches": 4, "run_dir": "runs/demo"},
}


def _device_line(devices: int | None) -> str:
    """What the run trains on: the platform, and how many of this host's devices it uses (``train.devices``)."""
    dev, seen = jax.devices()[0], jax.device_count()
    used = seen if devices is None else min(devices, seen)
    return (f"{dev.platform} ({getattr(dev, 'device_kind', dev)}), {used} device(s)"
            + (f" of the {seen} visible" if used < seen else ""))


# A profiled step's lanes (Engine.steps) against the step-time model's busy queues (plan.step_time.QUEUES).
PROFILE_LANES = (("GPU", ("compute", "device_update"), "gpu"), ("to the GPU", ("h2d",), "h2d"),
                 ("to the host", ("d2h",), "d2h"), ("host update", ("host_update",), "host"))


def profile_line(m: dict, predicted) -> str:
    """The line ``train`` prints for a profiled step (``train.profile_step``): each lane's serialized seconds,
    beside the plan's busy seconds for it where the step-time model knows this GPU (``predicted``, a
    ``StepTime``)."""
    words = []
    for name, lanes, queue in PROFILE_LANES:
        seconds = sum(m[f"profile_{lane}_s"] for lane in lanes)
        words.append(f"{name} {seconds:.2f} s" + ("" if predicted is None else
                                                  f" (plan {predicted.busy.get(queue, 0.0):.2f})"))
    return (f"  step {m['step']} profiled, each op waited for before the next: {', '.join(words)}; serialized "
            f"{m['profile_serialized_s']:.2f} s" + ("" if predicted is None else
                                                    f" (the plan's overlapped step: {predicted.seconds:.2f} s)"))


def _first_step(fn: Callable[[], None]) -> Hook:
    """A hook calling ``fn()`` once, at the first step."""
    done: list[bool] = []

    def call(m: dict, info) -> None:
        if not done:
            done.append(True)
            fn()
    return Hook(call)


# What refuses a start after fit's checks passed (the data's state, the checkpoint's tensors, a first batch the
# model cannot take): the command line's bad-input failures (exit status 2)
REFUSALS = (ValueError, FileNotFoundError, FileExistsError, CorruptCheckpointError)


def gpu_at_hand() -> bool:
    """Whether this process runs on GPUs (the plan then reads XLA's figures for the compiled programs)."""
    return jax.devices()[0].platform == "gpu"


def _memory_line(memory: MemoryPlan, estimate: MemoryPlan | None = None) -> str:
    if jax.devices()[0].platform == "cpu":
        return (f"  planned memory: {memory.host_total / 2**30:.1f} GiB of host RAM (no GPU: the model's layers "
                f"run on the CPU, in host memory)")
    of = "" if memory.gpu_available is None else f" of the {memory.gpu_available / 2**30:.1f} GiB XLA may use"
    how = "an estimate from rules of thumb"
    if memory.gpu_exact:
        how = "with XLA's memory analysis of the compiled programs"
        if estimate is not None and estimate.engine_cfg == memory.engine_cfg:
            how += f"; the estimate was {estimate.gpu_total / 2**30:.1f} GiB"
    source = gpu_fraction_source()
    share = (f"{gpu_fraction():.0%} of the GPU, JAX's default" if source == "JAX's default" else
             f"{gpu_fraction():.0%} of the GPU: {gpu_fraction_var()}={gpu_fraction():g}, set by {source}")
    return (f"  planned memory: host {memory.host_total / 2**30:.1f} GiB, GPU {memory.gpu_total / 2**30:.1f} GiB{of} "
            f"({how}; {share}; megatrain-jax plan shows the breakdown)")


def _out_of_memory_advice(memory: MemoryPlan, err: DeviceOutOfMemoryError, checkpoints: bool = True,
                          given: EngineConfig | None = None) -> str:
    """What to run instead after a step ran out of GPU memory: the plan's options re-planned for the GPU
    memory less the allocation that failed (the plan had counted too little by at least that much)."""
    if not checkpoints:
        resume = "a new run (this one keeps no checkpoints: set train.checkpoint_every to keep some)"
    else:
        resume = "train.resume=true" + ("" if err.updated else f" continues from step {err.step}")
    if err.host_pool:
        return _host_pool_advice(memory, resume)
    if memory.gpu_available is None or not err.requested:
        return f"to go on: {resume}, with more GPU memory or a layout that needs less (megatrain-jax plan)"
    budget = memory.gpu_available - err.requested
    fitting = options(memory.replace(gpu_bytes=budget), given)
    lines = [f"the plan had {memory.gpu_total / GiB:.1f} GiB of {memory.gpu_available / GiB:.1f} GiB; re-planned "
             f"for {budget / GiB:.1f} GiB (less the {err.requested / GiB:.2f} GiB allocation that failed), these "
             f"fit; add one to {resume}:"]
    lines += [f"  - {o}" for o in fitting] or ["  (none: a machine with more GPU memory)"]
    return "\n".join(lines)


def _host_pool_advice(memory: MemoryPlan, resume: str) -> str:
    """What to run instead after XLA's pinned host pool ran out: a higher cap where the host has room."""
    cap = host_pool_limit()
    if cap is None:
        return (f"XLA's pinned host pool ran out (no cap is set: XLA's default, 64 GB); the plan counts "
                f"{memory.host_pinned / GiB:.1f} GiB of pinned arrays. To go on: {resume}, with "
                f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB set above that, where host RAM allows")
    mine = user_host_pool_limit() is not None
    if mine:
        who = "set by you"
    elif cap == fitted_pool_limit(memory.host_pinned, memory.host_available, memory.devices):
        who = f"set by megatrain-jax train from the plan's {memory.host_pinned / GiB:.1f} GiB of pinned arrays, with headroom"
    else:  # JAX had started before train could fit the cap (a second run in one process): import's 90% of RAM
        who = "set when megatrain_jax was imported: JAX had started before train could fit it to the plan"
    higher = cap + 4 * GiB
    room = memory.host_available is None or higher <= memory.host_available
    raise_it = (f"with XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={-(-higher // GiB)}"
                + (" (or unset it: train then fits the cap to the plan)" if mine else "")
                + ("" if memory.host_available is None else
                   f"; the plan's host total is {memory.host_total / GiB:.1f} GiB of {memory.host_available / GiB:.1f}, "
                   f"and each GiB more of cap may take a GiB more of host RAM") + ", or ") if room else ""
    return (f"XLA's pinned host pool ran out: it is capped at {round(cap / GiB, 2):g} GiB "
            f"(XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, {who}); a step needs some GiB more than the arrays at times (the "
            f"gradients and weights in flight). To go on: {resume}, {raise_it}with a layout that pins less "
            f"(megatrain-jax plan: fewer streamed parts, capacity mode)")


def train(cfg: RunConfig, stream: TextIO | None = None) -> History:
    """Run ``cfg``: returns fit's History (``history.engine`` holds the trained host state). The run folder
    and the checkpoint folder are locked for the run's life (``run_lock``): a second run into either is refused
    at once."""
    out = stream or sys.stdout
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    t, why = checkpoint_for_export(cfg.train, distributed.requested())
    if why:
        cfg = dataclasses.replace(cfg, train=t)
        say(f"megatrain_jax: {why}")
    check_output_paths(t)  # every folder and file the run writes, before anything is created or loaded
    locks = [RunLock(Path(t.run_dir), distributed.process_id())]
    # the checkpoint folder where the run saves, locked once where it is the run folder itself
    if t.for_fit().checkpoint_dir is not None and t.checkpoint_folder().resolve() != Path(t.run_dir).resolve():
        locks.append(RunLock(t.checkpoint_folder(), distributed.process_id(), what="checkpoint folder",
                             key="train.checkpoint_dir"))
    held = []
    try:
        for lock in locks:
            took_over = lock.acquire()
            held.append(lock)
            if took_over:
                say(f"megatrain_jax: {took_over}")
        return _train(cfg, out, say)
    finally:
        for lock in reversed(held):
            lock.release()


def checkpoint_for_export(t: TrainSection, several_processes: bool) -> tuple[TrainSection, str | None]:
    """``t``, saving a checkpoint at the run's end where it exports with several processes and saves none: each
    process holds its own share of the trained state, and only a checkpoint writes it whole, so the export's
    guard (``export_guard``) finds the state on disk before the export starts. Returns the config and the
    sentence saying so (None: as given)."""
    if not (t.export_hf and several_processes) or t.for_fit().checkpoint_dir is not None:
        return t, None
    folder = t.checkpoint_folder()
    return dataclasses.replace(t, checkpoint_dir=str(folder)), (
        f"with several processes the trained state is written whole only by a checkpoint: this run saves one at "
        f"its end in {folder} before the export to {t.export_hf} (train.checkpoint_dir chooses where, "
        f"train.checkpoint_every adds more)")


def _train(cfg: RunConfig, out: TextIO, say) -> History:
    cfg = cfg.with_tokenizer()  # the checkpoint's own tokenizer where [data] names none
    t, d = cfg.train, cfg.data
    run_dir = Path(t.run_dir)
    model_cfg = cfg.model.build()
    positions = check_positions(d, model_cfg)  # windows past max_positions raise (parse_config refuses them first)
    if positions is not None:
        say(f"  note: {positions}")
    if t.export_hf:  # before training, not after: the model must be one transformers can hold, and the
        from megatrain_jax.hf.config import check_exportable  # folder free of another model unless replaced
        check_exportable(model_cfg)
        check_target(t.export_hf, t.export_overwrite, "set train.export_overwrite=true",
                     source=cfg.model.hf_checkpoint)
        t = dataclasses.replace(t, export_hf=str(Path(t.export_hf).absolute()))  # config.toml says where
        cfg = dataclasses.replace(cfg, train=t)

    model = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(t.seed)))
    pieces = packed_pieces(model_cfg, d)
    # data that build, build_eval or a batch would refuse, refused before anything is written or loaded (as plan does)
    epoch = d.check(model_cfg.vocab_size, pieces, model_cfg.max_positions, bool(t.eval_interval(d.eval_fraction)))
    # what the rows hold (packed rows' span, the share out of the loss), which the step-time model counts
    # (instruction data is tokenized here, once, into its cache)
    mix = d.row_mix(model_cfg.vocab_size, pieces)
    engine_cfg, memory, estimate, repicked, machine = _layout(cfg, model_cfg, model, say, mix)
    check_disk_room(t, model_cfg, engine_cfg)  # before anything is written: a save or export that cannot fit
    cfg, given = dataclasses.replace(cfg, engine=engine_cfg), cfg.engine
    say(f"megatrain_jax: {model_cfg.param_count() / 1e6:,.1f} M params ({model_cfg.layers} layers, hidden "
        f"{model_cfg.hidden}), {d.batch_size} x {d.seq_len} tokens per batch, {t.steps} steps on "
        f"{_device_line(t.devices)}; run folder {run_dir}")
    if repicked:
        say(f"megatrain_jax: {repicked}")
    say(_memory_line(memory, estimate))
    step = (for_machine(model_cfg, cfg.engine, d.batch_size, d.seq_len, machine, mix=mix)
            if gpu_at_hand() else None)
    if step is not None or gpu_at_hand():
        say(step_line(step, d.batch_size * d.seq_len * cfg.engine.accumulate_steps, machine))  # an optimizer step
    note = prepare_run_folder(cfg)
    if note:
        say(note)
    plan_record = {**memory.as_dict(),
                   "estimate_gpu_total": estimate.gpu_total if estimate.engine_cfg == memory.engine_cfg else None,
                   "predicted_step": None if step is None else step.as_dict()}

    optimizer, _ = cfg.optimizer.build(t.steps)
    if cfg.optimizer.warmup_steps >= t.steps > 1:  # the schedule fits the warm-up into the run
        say(f"  note: optimizer.warmup_steps={cfg.optimizer.warmup_steps} is not under train.steps={t.steps}: the rate "
            f"warms up over the first {t.steps - 1} steps and reaches optimizer.lr only at the last")
    objective, held_out = NextToken(), None
    if d.format == "preference":  # DPO: the reference pass on the initial weights, once the engine holds them
        data, summary, objective, held_out = _preference_data(cfg, model_cfg, say)
    else:
        data = d.build(model_cfg.vocab_size, max_pieces=pieces)
        summary = d.chat_summary()
    if summary is not None and d.format == "chat":  # what tokenizing it kept and dropped, said and kept with the run
        say(f"  data: {summary['kept']:,} examples, {summary['tokens']:,} tokens from {summary['file']}; "
            f"{summary['truncated']:,} truncated to seq_len + 1 = {d.seq_len + 1} tokens, "
            f"{summary['skipped_too_long']:,} skipped as too long, {summary['skipped_no_loss']:,} skipped with no "
            f"answer token left (data.too_long = {d.too_long!r}); in {run_dir / 'data_stats.json'}")
        for note in summary.get("notes", ()):  # allowed but likely unmeant (answers that never teach to stop)
            say(f"  note: {note}")
    rows = 2 * summary["pairs"] if d.format == "preference" else None if epoch is None else epoch * d.batch_size
    if rows is not None and t.steps * d.batch_size > rows:  # the steps outrun the data: it is gone over again
        say(f"  note: train.steps={t.steps} batches of {d.batch_size} rows go over the training split's {rows:,} rows "
            f"{t.steps * d.batch_size / rows:.1f} times, reshuffled each time"
            + (": a batch holds some pairs more than once" if rows < d.batch_size else ""))
    init_from = None  # after the data is read: bad data is refused before the weights are opened
    if cfg.model.hf_checkpoint is not None:  # read part by part into the engine's state: no model copy
        from megatrain_jax.hf import HFParts
        say(f"  loading weights from {cfg.model.hf_checkpoint}")
        init_from = HFParts(cfg.model.hf_checkpoint, model_cfg)

    before: dict[Path, bytes | None] = {}  # what started() replaced, put back when the start is refused after all
    first_process = distributed.process_id() == 0  # with several processes, the first writes the run's records

    def started(step: int) -> None:
        """Every check has passed (fit's too: the checkpoint and its model) and the model is about to load: the
        plan this start runs with, and what the data kept, are written now, so that a run that dies loading or
        in its first step (out of memory, killed) leaves them. A refused start (here, or later: the data or the
        checkpoint's tensors refused as the engine restores them), or one with nothing to train, leaves the folder
        as it was."""
        if t.profile_step and step >= t.profile_step:
            say(f"  note: train.profile_step={t.profile_step} is not after this run's start (step {step}): no step "
                f"is profiled")
        if step < t.steps and first_process:  # one writer of the run folder's records
            files = {"memory_plan.json": plan_record, **({"data_stats.json": summary} if summary is not None else {})}
            for name, record in files.items():
                path = run_dir / name
                before[path] = path.read_bytes() if path.exists() else None
                path.write_text(json.dumps(record, indent=1))
            if t.resume and not (run_dir / "metrics.jsonl").exists():
                rebuilt = rebuild_metrics(run_dir, t.checkpoint_folder(), step)  # the run folder lost them
                if rebuilt:
                    before[run_dir / "metrics.jsonl"] = None  # a refused start takes them away again
                    say(f"  note: {rebuilt}")

    # config.toml with the first step's metrics: a folder holds a run once a step trained (run_files), and a start
    # that died before that can be run again as it was
    hooks, writers = [_first_step(lambda: write_config(cfg, run_dir))] if first_process else [], []
    every = t.eval_interval(d.eval_fraction)
    if every:
        batches = t.eval_batches
        if held_out is not None:  # preference pairs: the objective itself on the held-out pairs
            hooks.append(eval_hook(None, every, t.steps, measure=held_out))
        else:
            eval_batches = list(itertools.islice(d.build_eval(model_cfg.vocab_size, pieces), t.eval_batches))
            hooks.append(eval_hook(eval_batches, every, t.steps))
            batches = len(eval_batches)  # what the held-out part holds, up to train.eval_batches
        if t.eval_every is None:
            held = ("" if batches == t.eval_batches else
                    f", all the held-out part holds of train.eval_batches={t.eval_batches}")
            say(f"  evaluating the held-out {d.eval_fraction:g} of the data every {every} steps ({batches} "
                f"batch{'es' if batches != 1 else ''}{held}; set train.eval_every to change it, 0 for none)")
    elif d.eval_fraction > 0:  # held out, and never looked at
        say(f"  note: data.eval_fraction={d.eval_fraction:g} holds out that share of the data, which "
            f"train.eval_every=0 never evaluates and the run does not train on; set data.eval_fraction=0 to train "
            f"on all of it")
    hooks.append(memory_hook())
    if t.profile_step:
        predicted = step  # the plan's StepTime (None where the step-time model does not know this GPU)
        hooks.append(Hook(lambda m, info: say(profile_line(m, predicted)) if m.get("profiled") else None))
    writers.append(JsonlWriter(run_dir / "metrics.jsonl", append=bool(t.resume)))
    if cfg.log.tensorboard and TensorBoardWriter.available():
        writers.append(TensorBoardWriter(run_dir))
    if cfg.log.wandb:
        if WandbLogger.available():
            writers.append(WandbLogger(cfg.log.wandb_project, cfg.log.wandb_name, to_dict(cfg), run_dir))
        else:
            say("  note: [log] wandb = true but wandb is not installed (pip install wandb); not logging to W&B")
    progress = Progress(t.steps, t.log_every, cfg.log.progress if first_process else "off", out)
    writers.append(progress)
    hooks += [w.hook() for w in writers]

    try:
        history = fit(model, data, optimizer, train=t.for_fit(), engine=cfg.engine, hooks=hooks, write_back=False,
                      init_from=init_from, on_start=started, objective=objective)
    except DeviceOutOfMemoryError as err:
        err.add_note(_out_of_memory_advice(memory, err, t.for_fit().checkpointing, given))
        raise
    except REFUSALS as err:
        if not getattr(err, "history", None):  # refused before a step trained: the folder goes back as it was
            for path, content in before.items():
                if content is None:
                    path.unlink(missing_ok=True)
                else:
                    path.write_bytes(content)
        raise
    finally:
        for w in writers:
            w.close()
        if hasattr(data, "close"):
            data.close()

    _finish(history, cfg, model_cfg, say)
    return history


def _preference_data(cfg: RunConfig, model_cfg, say) -> tuple[Callable, dict, DPO, Callable | None]:
    """``format = 'preference'``: the pairs tokenized and split (the last ``eval_fraction`` held out, the first
    ``eval_batches`` batches' worth of them evaluated), said, and the training stream as a function of the engine
    (``fit``'s ``data``): a fresh start takes every pair's reference log-probabilities with the engine's initial
    weights (the model before training) and writes them to ``dpo_reference.npy`` in the run folder (the held-out
    pairs' after the training pairs'); a resumed run reads them back (or, where the file is missing, takes them
    again before its checkpoint is restored). The last item evaluates the held-out pairs (None without any)."""
    from megatrain_jax.data.preference import evaluate_pairs, pair_logps, read_reference, write_reference
    d, t, run_dir = cfg.data, cfg.train, Path(cfg.train.run_dir)
    if jax.process_count() > 1:
        raise ValueError(f"preference data (format = 'preference') runs in one process: this run has "
                         f"{jax.process_count()} (jax.distributed); each would feed every pair. Use one process "
                         f"(several GPUs of one host are fine)")
    everything, stats = d.preference_pairs(model_cfg.vocab_size)
    pairs, held_out = everything.split(d.eval_fraction)
    held = None if held_out is None else held_out.first(t.eval_batches * d.batch_size // 2)
    summary = {"file": str(d.path), "tokenizer": str(d.tokenizer), "seq_len": d.seq_len, "too_long": d.too_long,
               **dataclasses.asdict(stats), "pairs": len(pairs), "held_out_pairs": 0 if held is None else len(held),
               "held_out_unused": 0 if held is None else len(held_out) - len(held)}
    unused = "" if not summary["held_out_unused"] else (
        f" ({len(held):,} of them evaluated, train.eval_batches={t.eval_batches} batches' worth: the other "
        f"{summary['held_out_unused']:,} neither train nor evaluate; a smaller data.eval_fraction trains on them)")
    say(f"  data: {len(pairs):,} preference pairs from {d.path}" + ("" if held is None else
        f" and {len(held_out):,} held out{unused}") + f"; {stats.truncated:,} truncated to seq_len + 1 = "
        f"{d.seq_len + 1} tokens, {stats.skipped_too_long:,} skipped as too long, {stats.skipped_no_loss:,} skipped "
        f"with no response token left (data.too_long = {d.too_long!r}), {stats.skipped_identical:,} skipped with "
        f"both sides the same; DPO beta {cfg.dpo.beta:g}, label smoothing {cfg.dpo.label_smoothing:g}")
    for note in stats.notes:  # allowed but likely unmeant (an empty response)
        say(f"  note: {note}")
    saved = run_dir / "dpo_reference.npy"
    sets = [pairs] + ([held] if held is not None else [])
    n = sum(len(x) for x in sets)
    ref: dict[str, np.ndarray] = {}

    # a resume's values are the ones the run started with, not a recomputation: read (and refused, where they are
    # of other pairs) now, before the weights load
    kept = read_reference(saved, sets) if t.resume and saved.exists() else None

    def stream(engine) -> Iterable[Batch]:
        if kept is not None:
            values = kept
            say(f"  reference log-probabilities of {n:,} pairs read from {saved}")
        else:
            t0 = time.perf_counter()
            values = np.concatenate([pair_logps(engine, x, d.batch_size) for x in sets])
            write_reference(saved, values, sets)
            say(f"  reference pass: {n:,} pairs' log-probabilities under the initial weights in "
                f"{time.perf_counter() - t0:.1f} s, in {saved}")
        ref["train"], ref["held_out"] = values[:len(pairs)], values[len(pairs):]
        return pairs.batches(d.batch_size, d.seed, ref["train"])

    def measure(engine) -> dict[str, float]:
        return evaluate_pairs(engine, held, ref["held_out"], d.batch_size)
    return stream, summary, cfg.dpo, None if held is None else measure


def packed_pieces(model_cfg, d) -> int | None:
    """The most documents a packed row of ``d`` (a ``DataConfig``) may hold: what the model's attention takes per
    row less the row's padding (``DecoderConfig.segments_per_row``); None where rows are not packed."""
    if d.mode != "packed":
        return None
    pieces = model_cfg.segments_per_row(d.seq_len) - 1
    if pieces < 1:
        raise ValueError(f"data.mode = 'packed' needs model.max_segments >= 2 (a row's padding counts as one "
                         f"segment), got {model_cfg.max_segments}")
    return pieces


def _layout(cfg: RunConfig, model_cfg, model: nnx.Module, say,
            mix: RowMix | None = None) -> tuple[EngineConfig, MemoryPlan, MemoryPlan, str | None, Machine]:
    """The engine config the run runs with (``plan.resolve`` on this machine, then, on a GPU, with XLA's figures
    for the compiled programs: ``plan.exact_plan``), said where it differs from the config; its plan, the
    estimate from rules of thumb, and what XLA's figures changed (said after the start line). Refuses a run
    that does not fit unless ``train.memory_check`` is off. Also returns the machine as read. ``mix``: what the
    rows hold (``DataConfig.row_mix``), for the step-time model's "auto" picks."""
    t, d, run_dir = cfg.train, cfg.data, Path(cfg.train.run_dir)
    machine = Machine.here(t.devices, several_processes=distributed.requested())
    packed, disk_dir = d.mode == "packed", str(run_dir / "disk_tier")
    end = dict(export=bool(t.export_hf), checkpoints=t.for_fit().checkpointing)  # the plan counts the run's end
    given, resolved = cfg.engine, resolve(model_cfg, cfg.engine, d.batch_size, d.seq_len, machine, packed=packed,
                                          disk_dir=disk_dir, mix=mix, **end)
    if resolved.said is not None:  # memory is short, or the config asked for a pick: the sentence says what ran
        say(f"megatrain_jax: {resolved.said}")
    cfg = dataclasses.replace(cfg, engine=resolved.engine_cfg)
    kw = dict(packed=packed, devices=machine.gpus, **end)
    fit_host_pool(model_cfg, cfg.engine, d.batch_size, d.seq_len, **kw)  # before JAX starts its GPU backend
    memory = plan(model_cfg, cfg.engine, d.batch_size, d.seq_len, host_pool_limit=host_pool_limit(), **kw)
    estimate, repicked = memory, None
    if gpu_at_hand() and not machine.several_processes:
        memory, repicked = exact_plan(model, memory, given=given, devices=t.devices, disk_dir=disk_dir,
                                      check=t.memory_check, speeds=machine_speeds(machine),
                                      mix=mix)
        cfg = dataclasses.replace(cfg, engine=memory.engine_cfg)
    if t.memory_check:
        require_fit(memory, given)
    return cfg.engine, memory, estimate, repicked, machine


def _finish(history: History, cfg: RunConfig, model_cfg, say) -> None:
    """After training: the export ``train.export_hf`` asks for, and the line saying how the loss went."""
    t, d, run_dir = cfg.train, cfg.data, Path(cfg.train.run_dir)
    if t.export_hf:
        from megatrain_jax.hf import save_hf
        copied = tokenizer_files(d.tokenizer or cfg.model.hf_checkpoint)
        kept_in = t.checkpoint_folder() if t.for_fit().checkpointing else None
        with guarded_export(history.engine, t.export_hf, kept_in, run_dir, model_cfg, say):  # loses nothing
            save_hf(t.export_hf, model_cfg, *history.engine.parameters(), overwrite=t.export_overwrite,
                    extra_files=copied)
        say(f"  exported the trained model to {t.export_hf} (Hugging Face format, bfloat16"
            + (f"; with {', '.join(p.name for p in copied)}" if copied else "") + ")")
    if len(history):
        first, last = history.records[0], history.records[-1]
        evals = history["eval_loss"]
        say(f"done: loss {first['loss']:.4f} -> {last['loss']:.4f}"
            + (f" (next-token loss {first['lm_loss']:.4f} -> {last['lm_loss']:.4f}, the rest load balancing)"
               if "lm_loss" in first and "lm_loss" in last else "")
            + (f", eval loss {evals[-1]:.4f}" if evals else "")
            + f"; metrics in {run_dir / 'metrics.jsonl'} (megatrain-jax plot {run_dir} draws them)")
    else:  # resumed at or past train.steps: done already, as a finished run run again is (status 0)
        at = int(history.engine.state.step)
        say(f"nothing to train: the checkpoint this run resumed from holds step {at}, and train.steps = {t.steps} "
            f"counts from step 0 (a resumed run ends where the uninterrupted one would); the run folder is as it was. "
            f"To train on, set train.steps above {at} (train.steps={at + t.steps} trains {t.steps} more)")
