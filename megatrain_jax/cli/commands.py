"""The ``megatrain-jax`` command line. It only parses arguments and calls the library.

    megatrain-jax                                   # the demo: tiny model, demo data, ~1 minute on a CPU
    megatrain-jax demo [section.key=value ...]      # the demo with overrides (e.g. train.steps=50)
    megatrain-jax train --config FILE.toml [section.key=value ...]
    megatrain-jax plan --config FILE.toml [section.key=value ...] [--host-gib N] [--gpu-gib N] [--exact]
                       [--gpu NAME] [--speeds FILE]
    megatrain-jax convert SRC DST [--to hf|npz|orbax] [--dtype bfloat16|float32]
    megatrain-jax plot RUN_DIR [--out FILE.png]

The engine benchmark is a script of the source repository, not a command: ``PYTHONPATH=. python
experiments/bench.py --configs NAME --out FILE.json`` (docs/command_line.md).

Exit statuses: 0 done; 1 an unexpected error (with its traceback); 2 bad input (config, data, checkpoint,
model) or a checkpoint that cannot be written (read-only folder, no permission, full disk, quota, I/O
error), with a message saying what to change; 3 training diverged (too many non-finite steps in a row, or
non-finite weights at the export); 4 a step ran out of GPU memory (before any update: the state of the last
whole step was saved to resume from; the message lists layouts that fit with less GPU memory); 129 / 130 / 143
stopped by SIGHUP / SIGINT / SIGTERM after saving the checkpoint to resume from, or after abandoning a save
that made no progress for 60 s (the message names the last complete checkpoint). No save can hang: docs/checkpoints_faults.md.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from megatrain_jax import distributed
from megatrain_jax._environment import gpu_fraction_source, gpu_fraction_var
from megatrain_jax.cli.plan_inputs import environment_notes, gib, gpu_gib, gpu_kind
from megatrain_jax.checkpoint.failures import CheckpointWriteError
from megatrain_jax.checkpoint.manager import CorruptCheckpointError
from megatrain_jax.checkpoint.session import CheckpointedExit
from megatrain_jax.cli.run_config import check_positions, load_config, parse_config
from megatrain_jax.cli.toml_dataclass import ConfigError
from megatrain_jax.contract.layered import ContractError
from megatrain_jax.engine.out_of_memory import DeviceOutOfMemoryError
from megatrain_jax.engine.update.disk_tier import DiskTierError
from megatrain_jax.engine.update.policy import NonFiniteError
from megatrain_jax.plan import GiB, MemoryPlanError

# Exit statuses (docs/command_line.md, "Exit statuses"). A run stopped by SIGTERM/SIGINT/SIGHUP after saving its checkpoint
# exits with the shell's status for the signal, 128 + its number: 143, 130 and 129 (CheckpointedExit).
EXIT_OK, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OUT_OF_MEMORY = 0, 2, 3, 4

EXAMPLES = """examples:
  megatrain-jax train --config experiments/configs/demo_tiny.toml train.steps=50 model.layers=4
  megatrain-jax plan --config experiments/configs/h100_7b_32k.toml --host-gib 125 --gpu-gib 80
  megatrain-jax convert ./Llama-3.2-1B ./llama1b_f32 --dtype float32
  megatrain-jax plot runs/demo
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="a TOML run config (see experiments/configs/)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override config values, e.g. model.layers=4 train.steps=20 engine.clip_norm=none")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatrain-jax", description="Train language models larger than GPU "
                                 "memory on one GPU. With no command, runs the demo.",
                                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("train", help="train from a TOML config")
    _add_config_args(p)
    p = sub.add_parser("demo", help="the demo (what no command runs): tiny model on the synthetic corpus")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p = sub.add_parser("plan", help="print the host and GPU memory plan of a config")
    _add_config_args(p)
    p.add_argument("--host-gib", type=gib, help="host RAM to plan for (default: this machine's MemAvailable)")
    p.add_argument("--gpu-gib", type=gpu_gib, help="GPU memory to plan for (default: the --gpu card's, else this "
                                               "GPU's, if any)")
    p.add_argument("--exact", action="store_true",
                   help="compile the run's programs on this machine's GPU and plan with XLA's figures for their "
                        "scratch memory, as train does (without it the GPU side is an estimate)")
    p.add_argument("--gpu", metavar="NAME", help="the GPU to plan for: its rates predict the step time, and its "
                                                 "memory is the GPU side's unless --gpu-gib says (H100, H200, GH200; "
                                                 "RTX 4090, L40S, RTX 6000 Ada: predicted from specifications; "
                                                 "default: this machine's)")
    p.add_argument("--speeds", metavar="FILE", help="a calibration file of rates for the step-time model (JSON; "
                                                    "docs/performance.md; default: $MEGATRAIN_SPEEDS)")
    p = sub.add_parser("convert", help="convert checkpoints: Hugging Face <-> npz (<-> Orbax)")
    p.add_argument("src", help="a Hugging Face folder (config.json + safetensors) or a .npz")
    p.add_argument("dst", help="output: a folder (Hugging Face) or a .npz file")
    p.add_argument("--to", choices=("hf", "npz", "orbax"), help="output format (default: from dst)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="tensor dtype of a Hugging Face output (default bfloat16)")
    p.add_argument("--force", action="store_true",
                   help="replace a model already in the Hugging Face output folder (as a whole)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a folder whose tokenizer and generation files go with a Hugging Face output (the model the "
                        "weights were trained from, say; default: those of a Hugging Face source)")
    p = sub.add_parser("plot", help="PNG of loss, eval loss and throughput of a run")
    p.add_argument("run_dir", help="a run folder (train.run_dir), or a metrics .jsonl file in one")
    p.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    return ap


def cmd_train(args: argparse.Namespace) -> int:
    from megatrain_jax.cli.run import train
    if args.config is None and not args.overrides:
        raise ConfigError("train needs --config FILE.toml (or section.key=value overrides of the defaults); "
                          "see experiments/configs/, or run the demo with no arguments")
    finished(train(load_config(args.config, args.overrides)))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from megatrain_jax.cli.run import DEMO, train
    from megatrain_jax.cli.run_folder import run_files
    overrides = list(args.overrides)
    if not any(o.strip().startswith("train.run_dir=") for o in overrides):  # run again: a new folder, not an error
        base, n = DEMO["train"]["run_dir"], 1
        run_dir = base
        while run_files(Path(run_dir)):
            n += 1
            run_dir = f"{base}-{n}"
        overrides.append(f"train.run_dir={run_dir}")
    finished(train(parse_config(DEMO, "the built-in demo config", overrides)))
    return 0


def finished(history) -> None:
    """A run that ended well releases what outlives its steps: the disk tier's files (engine.disk_parts) are
    deleted, since checkpoints and the export hold what was trained. A run that failed keeps them: its resume
    reuses their room (``disk_tier.held_bytes``)."""
    history.engine.close()


def cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses

    from megatrain_jax.plan import (Machine, advice, gpu_fraction, in_each_mode, longest_seq_len, modes_table, plan,
                                    resolve)
    from megatrain_jax.plan.machine import gpu_name_before_jax
    from megatrain_jax.plan.speeds import MEMORY_GIB, SPEEDS_VAR, kind_of
    from megatrain_jax.plan.step_time import for_machine, machine_speeds, step_line
    named = gpu_kind(args.gpu, args.speeds)  # a misspelt name refused before anything is read
    cfg = load_config(args.config, args.overrides)
    host = None if args.host_gib is None else int(args.host_gib * GiB)
    gpu_gib, whose = args.gpu_gib, ""
    if gpu_gib is None and named in MEMORY_GIB and kind_of(gpu_name_before_jax()) != named:
        gpu_gib, whose = MEMORY_GIB[named], f" (the {named}'s; --gpu-gib for another)"  # that GPU's, not this one's
    gpu = None if gpu_gib is None else int(gpu_gib * GiB * gpu_fraction())
    if gpu is not None:
        set_by = ("JAX's default" if gpu_fraction_source() == "JAX's default" else
                  f"{gpu_fraction_var()}, set by {gpu_fraction_source()}")
        print(f"GPU of {gpu_gib:g} GiB{whose}: XLA may allocate {gpu_fraction():.0%} of it, {gpu / GiB:.2f} GiB "
              f"({set_by})")
    model_cfg, d = cfg.model.build(), cfg.with_tokenizer().data
    note = check_positions(d, model_cfg)  # windows past max_positions were refused as the config was read
    if note is not None:
        print(f"note: {note}")
    if cfg.model.hf_checkpoint is not None:
        _check_weights(cfg.model.hf_checkpoint, model_cfg)
    if args.speeds is not None:  # as MEGATRAIN_SPEEDS: the layout's pick reads the same rates as the prediction
        os.environ[SPEEDS_VAR] = args.speeds
    # another GPU's plan is for its host, not this one: this host's update is not timed for it
    machine = Machine.here(cfg.train.devices, host_ram_bytes=host, gpu_bytes=gpu, time_host=args.gpu is None)
    for note in environment_notes(gpu is None):
        print(f"note: {note}")
    if args.gpu is not None:
        machine = dataclasses.replace(machine, gpu_name=args.gpu, host_cores=None,  # that GPU's host, not this one
                                      host_measured=None)
    if machine.gpus > 1:
        print(f"per GPU of {machine.gpus}: each takes 1/{machine.gpus} of every batch and holds a shard of the state")
    packed, disk_dir = d.mode == "packed", str(Path(cfg.train.run_dir) / "disk_tier")
    end = dict(export=bool(cfg.train.export_hf), checkpoints=cfg.train.for_fit().checkpointing)
    mix = _row_mix(d, model_cfg, evaluate=bool(cfg.train.eval_interval(d.eval_fraction)))
    resolved = resolve(model_cfg, cfg.engine, d.batch_size, d.seq_len, machine, packed=packed, disk_dir=disk_dir,
                       mix=mix, **end)
    if resolved.said is not None:
        print(f"as `megatrain-jax train` would: {resolved.said}")
    p = plan(model_cfg, resolved.engine_cfg, d.batch_size, d.seq_len, host_ram_bytes=host, gpu_bytes=gpu,
             packed=packed, devices=machine.gpus, **end)
    if args.exact:
        p = _exact(p, cfg, model_cfg, disk_dir, machine_speeds(machine, args.speeds), mix)
    print(p.table())
    from megatrain_jax.cli.disk_room import disk_lines
    for line in disk_lines(cfg.train, model_cfg, p.engine_cfg):  # checkpoints and export, against this disk
        print(line)
    step = for_machine(model_cfg, p.engine_cfg, d.batch_size, d.seq_len, machine, args.speeds, mix=mix)
    print(step_line(step, d.batch_size * d.seq_len * p.engine_cfg.accumulate_steps, machine))  # an optimizer step
    modes = in_each_mode(p)
    print(modes_table(p, modes))
    longest = longest_seq_len(p)
    print(f"longest sequence that fits with {d.batch_size} rows per batch as configured: "
          + (f"{longest:,} tokens (of max_positions {model_cfg.max_positions:,})" if longest else
             "none: no length fits with these settings (what fits instead: below)"))
    if not p.fits:
        print(f"does not fit.\n{advice(p, cfg.engine, modes)}")
        return 1
    return 0


def _check_weights(folder: str, model_cfg) -> None:
    """The Hugging Face checkpoint's weights checked as ``train`` checks them at start, from the files' headers (no
    tensor is read but a few rows of a tied model's spare ``lm_head.weight``): weights ``train`` would refuse (a
    missing shard, a truncated file, a tensor of the wrong shape or dtype) are refused here too (ValueError: exit
    status 2). A folder with its config.json but no weights yet (the plan before the download) is a note."""
    from megatrain_jax.hf import HFParts
    from megatrain_jax.hf.safetensors_io import stale_files
    if not any(stale_files(Path(folder))):
        print(f"note: {folder} holds no weights here (config.json only): they are checked when train starts")
        return
    try:
        HFParts(folder, model_cfg).release()
    except ValueError as e:  # CheckpointMismatch, SafetensorsError, UnsupportedConfig
        raise ValueError(f"train would refuse these weights: {e}") from None


def _row_mix(d, model_cfg, evaluate: bool = False):
    """What the rows hold (``DataConfig.row_mix``, the rows made as ``train`` makes them: packed rows' span, the
    share out of the loss) for the step-time model; None for windows and preference pairs (whole rows, every token in
    the loss). The data is read and checked as ``train`` reads it at start (``DataConfig.check``; the held-out split
    too where the run evaluates), so that data here which ``train`` would refuse (a bad line of a JSONL file, token ids
    outside the vocabulary, a broken token file, a split without a whole batch) is refused here too (ValueError:
    exit status 2). Data that is not on this machine (the file or the tokenizer folder missing: the plan may be for
    another machine) is said, and planned as whole rows with every token in the loss, which over-counts packed rows'
    attention and short instruction data's backward."""
    from megatrain_jax.cli.run import packed_pieces
    pieces = packed_pieces(model_cfg, d)  # a packed row of one segment: refused as train refuses it, data or not
    used = (d.path,) if d.format == "tokens" else (d.path, d.tokenizer)
    absent = [f"{path} does not exist" for path in used if path is not None and not Path(path).exists()]
    whole = ("" if d.mode == "windows" or d.format == "preference" else  # whole rows, read or not
             f"; the predicted step takes whole rows of {d.seq_len:,} tokens, every one in the loss")
    if absent:
        print(f"note: the data cannot be read here ({'; '.join(absent)}){whole}")
        return None
    if d.format == "chat":
        print(f"reading {d.path} for what its rows hold (tokenized once into the cache)")
    elif d.format == "preference":
        print(f"reading {d.path} to check its pairs as train does at start (tokenized once into the cache)")
    try:
        if d.format == "preference":  # what train reads at start, from the cache; the step time counts whole rows
            d.preference_pairs(model_cfg.vocab_size)[0].split(d.eval_fraction)
            return None
        d.check(model_cfg.vocab_size, pieces, model_cfg.max_positions, evaluate)
        if d.mode == "windows":  # whole rows: nothing to count
            return None
        return d.row_mix(model_cfg.vocab_size, pieces)
    except ImportError as e:  # a package this machine lacks (tokenizers, jinja2): the plan may be for another
        print(f"note: the data cannot be read here ({e}){whole}")
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"train would refuse this data: {e}") from None


def _exact(estimate, cfg, model_cfg, disk_dir: str, speeds=None, mix=None):
    """``plan --exact``: the plan with XLA's figures for the run's programs compiled on this GPU, and what that
    changed, printed."""
    from flax import nnx

    from megatrain_jax.cli.run import gpu_at_hand
    from megatrain_jax.models import Decoder
    from megatrain_jax.plan import exact_plan
    if not gpu_at_hand():
        raise ConfigError("plan --exact compiles the run's programs on this machine's GPU, and it has none; "
                          "without --exact the plan's GPU side is the estimate")
    model = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
    p, again = exact_plan(model, estimate, given=cfg.engine, devices=cfg.train.devices, disk_dir=disk_dir,
                          speeds=speeds, mix=mix)
    print(again or f"with XLA's figures for the compiled programs: GPU {p.gpu_total / GiB:.2f} GiB (the "
                   f"estimate: {estimate.gpu_total / GiB:.2f})")
    return p


def cmd_convert(args: argparse.Namespace) -> int:
    from megatrain_jax.cli.convert import convert
    from megatrain_jax.hf.export_folder import VOCAB_FILES
    out = convert(args.src, args.dst, args.to, args.dtype, force=args.force, tokenizer=args.tokenizer)
    print(f"wrote {out}")
    if out.is_dir() and (out / "config.json").exists() and not any((out / n).exists() for n in VOCAB_FILES):
        print(f"note: {out} has no tokenizer: transformers loads the model but not its tokenizer from it. Add "
              f"--tokenizer DIR (the folder of the model it was trained from) to write one beside the weights")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from megatrain_jax.observe.plot import plot_run
    print(f"wrote {plot_run(args.run_dir, args.out)}")
    return 0


COMMANDS = {"train": cmd_train, "demo": cmd_demo, "plan": cmd_plan, "convert": cmd_convert,
            "plot": cmd_plot}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megatrain-jax`` and ``python -m megatrain_jax``; returns the exit status. Run as the
    program (``argv`` None), a run whose checkpoint could not be written, or whose save was abandoned after
    a stop signal, ends the process at once (``_end_now``)."""
    as_program = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    hint = meant(argv)
    if hint is not None:  # before argparse, whose "invalid choice" would not say what was meant
        print(f"megatrain-jax: error: {hint}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = build_parser().parse_args(argv)
    if args.command is None:
        args.command, args.overrides = "demo", []
    if as_program and not os.environ.get("MEGATRAIN_DEBUG"):
        _quiet_orbax_failures()
    try:
        if args.command == "train" and distributed.requested():  # several processes: before JAX starts
            distributed.initialize()
        return COMMANDS[args.command](args)
    except (CheckpointWriteError, DiskTierError) as e:  # a disk's state: said in a line, no traceback
        return _end_now(_failed(args.command, e, EXIT_BAD_INPUT), as_program)
    except CheckpointedExit as e:
        if e.abandoned:
            _end_now(e.code, as_program)
        raise
    except (ValueError, MemoryPlanError, FileNotFoundError, FileExistsError, ImportError, NotImplementedError,
            CorruptCheckpointError, ContractError) as e:
        return _failed(args.command, e, EXIT_BAD_INPUT)
    except OSError as e:  # a folder or file the user named cannot be used: their machine's state, not a bug
        if e.errno not in _PATH_ERRNOS:
            raise
        e.add_note(_path_advice(e, args.command))
        return _failed(args.command, e, EXIT_BAD_INPUT)
    except NonFiniteError as e:
        return _failed(args.command, e, EXIT_DIVERGED)
    except DeviceOutOfMemoryError as e:
        return _failed(args.command, e, EXIT_OUT_OF_MEMORY)
    except KeyboardInterrupt:
        print(f"\nmegatrain-jax {args.command}: interrupted", file=sys.stderr)
        return 130


def _quiet_orbax_failures() -> None:
    """Hold back what Orbax prints of a save that failed, which the command line says in a line of its own
    (``CheckpointWriteError``: what failed, the newest good checkpoint, what to do): its ERROR log records (absl's
    logger), and the tracebacks of TensorStore's callbacks into the event loop Orbax has closed by then ("Event loop
    is closed"), hundreds of lines for a full disk. ``MEGATRAIN_DEBUG=1`` shows them."""
    import logging

    class OrbaxErrors(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname

    logging.getLogger("absl").addFilter(OrbaxErrors())
    unraisable = sys.unraisablehook

    def unraisable_hook(u):
        if not (u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed"):
            unraisable(u)

    sys.unraisablehook = unraisable_hook


def meant(argv: Sequence[str]) -> str | None:
    """What a command line that argparse would refuse with a bare "invalid choice" or "unrecognized arguments" was
    meant to be: overrides or a config file given without a command (with none, the demo runs, which takes
    overrides only after ``demo``), a config file given to the demo (which runs its built-in config), or a
    misspelt command. None for any other command line, which argparse parses."""
    first = argv[0] if argv else None
    if first is None or first in ("-h", "--help") or (first in COMMANDS and first != "demo"):
        return None
    word = first not in COMMANDS and not first.startswith("-") and "=" not in first and not first.endswith(".toml")
    if word:  # a command, misspelt
        close = difflib.get_close_matches(first, list(COMMANDS), n=1, cutoff=0.6)
        return (f"unknown command {first!r}; did you mean: megatrain-jax {shlex.join([close[0], *argv[1:]])} "
                f"(commands: {', '.join(COMMANDS)})") if close else None
    config, rest = _config_file(argv[1:] if first == "demo" else argv)
    if config is not None:
        run = shlex.join(["--config", config, *rest])
        what = ("the demo runs its built-in config and reads no config file" if first == "demo" else
                "a config file is read by a command, after --config")
        return f"{what}: did you mean: megatrain-jax train {run} (or megatrain-jax plan {run})"
    if first != "demo" and "=" in first and not first.startswith("-"):
        return (f"{first!r} is not a command: overrides for the demo: megatrain-jax demo {shlex.join(argv)}; "
                f"to train from a config file: megatrain-jax train --config FILE.toml {shlex.join(argv)}")
    return None


def _config_file(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """The config file among ``args`` (``--config FILE``, ``-c FILE``, ``--config=FILE``, or a bare ``*.toml``),
    and the other arguments; ``(None, args)`` without one."""
    config, rest, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a in ("--config", "-c") and i + 1 < len(args):
            config, i = args[i + 1], i + 2
            continue
        if a.startswith("--config="):
            config = a.split("=", 1)[1]
        elif a.endswith(".toml") and "=" not in a and not a.startswith("-") and config is None:
            config = a
        else:
            rest.append(a)
        i += 1
    return config, rest


_PATH_ERRNOS = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                errno.EPERM: "permission denied", errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                errno.ENOTDIR: "a part of the path is a file, not a folder", errno.EISDIR: "it is a folder, not a file"}


def _path_advice(e: OSError, command: str) -> str:
    """What is wrong with the path ``e`` names, and what to do (``command``: the one that wrote there)."""
    folders = {"train": " (train.run_dir, train.checkpoint_dir, train.export_hf)", "demo": " (train.run_dir)",
               "convert": " (the output given to convert)"}.get(command, "")
    todo = (f"free space there or choose another folder{folders}" if e.errno in (errno.ENOSPC, errno.EDQUOT) else
            "check the path you gave" if e.errno in (errno.ENOTDIR, errno.EISDIR) else
            f"make it writable or choose another folder{folders}")
    return f"{e.filename or f'a path megatrain-jax {command} writes'}: {_PATH_ERRNOS[e.errno]}; {todo}"


def _end_now(status: int, as_program: bool) -> int:
    """``status``; as the program, the process ends here with it (``os._exit``, once the output is flushed).
    After a failed or abandoned save Orbax may keep threads that ``sys.exit`` would wait for: ones waiting
    (300 s) for a step directory that was never created, or a writer stuck in the file system."""
    if as_program:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _failed(command: str, e: BaseException, status: int) -> int:
    if os.environ.get("MEGATRAIN_DEBUG"):
        raise e
    notes = "".join(f"\n{note}" for note in getattr(e, "__notes__", ()))
    print(f"megatrain-jax {command}: error: {e}{notes}\n(MEGATRAIN_DEBUG=1 shows the traceback)", file=sys.stderr)
    return status
