"""What ``train`` runs, the layout: the engine config that a run config becomes on a machine (``resolve``),
and the sentence saying what was changed and why. ``megatrain-jax train``, ``megatrain-jax plan`` and
experiments/bench.py all call ``resolve``; what fits instead, for a run that does not, is ``levers``' job.

The config as given runs unless memory is short:

- ``resident_layers="auto"`` or ``kept_layers="auto"`` where the GPU's rates are known (``speeds``): the
  fastest layout that fits by the step-time model (``fastest``: each count of resident blocks with the most
  blocks keeping their products that fit beside it);
- ``kept_layers`` that the GPU cannot hold: the most blocks keeping their products that it can (``most_kept``;
  ``"auto"`` without rates: none);
- ``resident_layers="auto"`` without rates: the most GPU-resident blocks that fit (``most_resident``);
- the GPU short: fewer blocks fetched ahead, down to one, where that fits (``fewer_fetched_ahead``); else the
  fewest blocks whose inputs wait in host memory (``offload``);
- host RAM short: the lean host layout (``lean``: float32 streamed, gradients waiting on the GPU, the two-pass
  step; in capacity mode, 8-bit moments; last, the disk tier);
- nothing of that fitting while blocks keep their attention residuals: the same without them;
- then ``split_parts="auto"`` where the GPU's rates are known: how many host updates run in two passes, the
  count the step-time model finds fastest for the layout picked (``split_parts``).

Every candidate is an ``EngineConfig``: the config's own checks (``__post_init__``, ``check_layers``, the parts
each role names) say which combinations are legal (``legal``); nothing here restates them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from megatrain_jax.batch import RowMix
from megatrain_jax.engine import precision
from megatrain_jax.engine.config import AUTO, EngineConfig
from megatrain_jax.engine.parts import HostRoles
from megatrain_jax.engine.schedule import offloaded_blocks
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.plan.activations import assumes_flash, kept_bytes
from megatrain_jax.plan.counts import GiB, host_roles
from megatrain_jax.plan.machine import (GPU_FRAGMENTATION_MARGIN, Machine, available_disk_bytes, available_host_bytes,
                                        gpu_bytes_before_jax)
from megatrain_jax.plan.memory import MemoryPlan, plan
from megatrain_jax.plan.speeds import Speeds
from megatrain_jax.plan.step_time import machine_speeds, predict

Changes = tuple[tuple[str, Any], ...]  # (``section.key``, value) pairs: ``("engine.micro_batches", 4), ...``

# What the lean full-precision pick leaves free of the host's available memory where it can. The plan's host
# total has come out 0-4% under the peaks measured at step ends (tests/assets/measured/h100_plan_check.json), and
# the process cannot have all of MemAvailable: the shipped h200_sft_8b config, lean-picked with 3% on a 125.9 GiB
# H200 host (plan 120.0 GiB), was killed by the kernel's OOM killer at its final save with 122.5 GiB resident and
# growing (experiments/results/h200_shipped_configs_6014bc6_h200_sft_8b_c.json and its .mem.log): ~4% over the plan,
# and ~2.3% of the host out of reach. So 7%.
LEAN_HOST_MARGIN = 0.07


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The engine config a run runs with, and what was changed from the one given and why (None: as given)."""

    engine_cfg: EngineConfig
    said: str | None = None


def resolve(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int, machine: Machine,
            *, packed: bool = False, disk_dir: str | None = None, export: bool = False,
            checkpoints: bool = False, mix: RowMix | None = None) -> Resolved:
    """The engine config that runs ``engine_cfg`` on ``machine`` (module docstring), and the sentence saying
    what was changed. ``disk_dir`` (where the config sets none) is where the disk tier may go when nothing else
    fits. ``export``, ``checkpoints``: the run ends with a Hugging Face export, saves checkpoints (the plan counts
    the end of the run: ``memory.end_of_run``). ``mix``: what the rows hold (``batch.RowMix``: packed rows'
    span, the share of tokens out of the loss; ``TokenDataset.row_mix``), for the step-time model (None: whole
    rows). With several processes nothing is picked (each would pick from its own host), and
    ``resident_layers="auto"`` is refused. Reads nothing from JAX: it runs before JAX starts its GPU backend."""
    if machine.several_processes:
        for field in ("resident_layers", "kept_layers", "gpu_updated_layers", "gpu_updated_io"):
            if getattr(engine_cfg, field) == AUTO:
                raise ValueError(f"engine.{field}='auto' is picked from one host's memory plan; with several "
                                 f"processes set the number (megatrain-jax plan --config FILE prints the pick)")
        return Resolved(engine_cfg)
    kw: dict[str, Any] = dict(host_ram_bytes=machine.host_ram_bytes, gpu_bytes=machine.gpu_bytes,
                              devices=machine.gpus, packed=packed, export=export, checkpoints=checkpoints)
    if machine.disk_bytes is not None:
        kw["disk_bytes"] = machine.disk_bytes
    return Resolved(*_pick(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw, machine_speeds(machine),
                           mix))


def lean_engine(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                host_ram_bytes: int | None = None, disk_dir: str | None = None, gpu_bytes: int | None = None,
                speeds: Speeds | None = None, mix: RowMix | None = None,
                **plan_kw) -> tuple[EngineConfig, str | None]:
    """``resolve`` with the machine's figures as keywords (``host_ram_bytes`` default: this machine's
    MemAvailable; ``gpu_bytes``: ``gpu_bytes_before_jax()``; ``speeds``: the GPU's rates, for the "auto"
    fields' fastest pick, with what the rows hold (``mix``); ``plan_kw``: ``plan``'s ``devices``, ``packed``,
    ``disk_bytes``, ``programs``): the config and the sentence (None: as given)."""
    host_ram_bytes = available_host_bytes() if host_ram_bytes is None else host_ram_bytes
    gpu_bytes = gpu_bytes_before_jax() if gpu_bytes is None else gpu_bytes
    return _pick(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir,
                 dict(host_ram_bytes=host_ram_bytes, gpu_bytes=gpu_bytes, **plan_kw), speeds, mix)


def _pick(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw, speeds: Speeds | None = None,
          mix: RowMix | None = None) -> tuple[EngineConfig, str | None]:
    """The layout, then the split count; with ``gpu_updated_io`` "auto" the whole pick is made with the io part
    updated on the host and on the GPU, and of the picks that fit the faster by the step-time model taken (the
    host among equals; the host's where neither fits, or the GPU's cannot be made: the counts the config sets
    name more host parts than there are without the io part)."""
    if engine_cfg.gpu_updated_io != AUTO:
        return _pick_one(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw, speeds, mix)
    host = _pick_one(model_cfg, dataclasses.replace(engine_cfg, gpu_updated_io=False), batch_rows, seq_len, disk_dir,
                     kw, speeds, mix)
    mode = precision.mode_of(engine_cfg, model_cfg.dtype)
    if speeds is None or engine_cfg.resident_io or mode.stochastic or engine_cfg.norm_first:
        return host  # the io part cannot be updated on the GPU here, or nothing weighs it
    on_gpu = dataclasses.replace(engine_cfg, gpu_updated_io=True)
    if not _takes(model_cfg.layers, on_gpu):
        return host  # the config's counts name more host parts than there are without the io part
    gpu = _pick_one(model_cfg, on_gpu, batch_rows, seq_len, disk_dir, kw, speeds, mix)
    host_fits, gpu_fits = (plan(model_cfg, arm[0], batch_rows, seq_len, detect=False, **kw).fits for arm in (host, gpu))
    if not gpu_fits:
        return host
    devices = kw.get("devices", 1)
    t_host, t_gpu = (predict(model_cfg, e, batch_rows, seq_len, speeds, devices=devices,
                             mix=mix).seconds
                     for e in (host[0], gpu[0]))
    picked, said = gpu if t_gpu < t_host or not host_fits else host
    where = "on the GPU" if picked is gpu[0] else "on the host"
    why = (f"{t_gpu:.2f} s per step on the GPU against {t_host:.2f} s on the host, by the step-time model at "
           f"{speeds.name}" + ("; on the host the run does not fit" if not host_fits else ""))
    return picked, "; ".join(w for w in (said, f"engine.gpu_updated_io='auto': the io part updated {where} ({why})")
                             if w)


def _pick_one(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw, speeds: Speeds | None = None,
              mix: RowMix | None = None) -> tuple[EngineConfig, str | None]:
    picked, said = _pick_layout(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw, speeds, mix)
    picked, split = split_parts(model_cfg, picked, batch_rows, seq_len, speeds, kw.get("devices", 1), mix)
    return picked, "; ".join(w for w in (said, split) if w) or None


def split_parts(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                speeds: Speeds | None, devices: int = 1,
                mix: RowMix | None = None) -> tuple[EngineConfig, str | None]:
    """``split_parts`` where it is "auto" and ``speeds`` are known: the count the step-time model finds fastest
    (the most among equals: the engine's own choice). Returns the config and, where fewer than every part
    split, a sentence."""
    if engine_cfg.split_parts != AUTO or speeds is None:
        return engine_cfg, None
    n = len(host_roles(model_cfg, engine_cfg).splitting(AUTO))
    if n == 0 or not engine_cfg.precision.stream_copy or not engine_cfg.host_kernel or engine_cfg.norm_first:
        return engine_cfg, None  # nothing could split: nothing to pick
    times = {k: predict(model_cfg, dataclasses.replace(engine_cfg, split_parts=k), batch_rows, seq_len, speeds,
                        devices=devices, mix=mix).seconds for k in range(n + 1)}
    best = min(sorted(times, reverse=True), key=lambda k: times[k])
    picked = dataclasses.replace(engine_cfg, split_parts=best)
    if best == n:
        return picked, (f"engine.split_parts='auto': all {n} host updates in two passes ({times[n]:.2f} s per step "
                        f"against {times[0]:.2f} s in one, by the step-time model at {speeds.name})")
    return picked, (f"engine.split_parts='auto': {best} of the {n} host updates in two passes, the rest in one "
                    f"({times[best]:.2f} s per step against {times[n]:.2f} s with all split, by the step-time "
                    f"model at {speeds.name})")


def _pick_layout(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw, speeds: Speeds | None = None,
                 mix: RowMix | None = None) -> tuple[EngineConfig, str | None]:
    fast, asked = None, engine_cfg
    if speeds is not None and AUTO in (engine_cfg.resident_layers, engine_cfg.kept_layers,
                                       engine_cfg.gpu_updated_layers):
        engine_cfg, fast = fastest(model_cfg, engine_cfg, batch_rows, seq_len, speeds, mix, **kw)
    timed = fast is not None  # fastest picked the "auto" fields (else nothing fit as configured, or no rates)
    if engine_cfg.gpu_updated_layers == AUTO:  # not picked above: none (nothing weighs what they would cost)
        engine_cfg = dataclasses.replace(engine_cfg, gpu_updated_layers=0)
    if engine_cfg.kept_layers == AUTO:
        engine_cfg = dataclasses.replace(engine_cfg, kept_layers=0)
        fast = fast or ("engine.kept_layers='auto': 0 (" + (
            "no GPU to plan for" if kw.get("gpu_bytes") is None else
            "no rates for this machine's GPU to weigh kept matrix products against resident blocks: "
            "docs/performance.md" if speeds is None else
            "no layout fits host and GPU as configured, so none is timed: the host layout is made leaner "
            "first") + ")")
    engine_cfg, fewer_kept = most_kept(model_cfg, engine_cfg, batch_rows, seq_len, **kw)
    engine_cfg, auto = most_resident(model_cfg, engine_cfg, batch_rows, seq_len, **kw)
    picked, said = _fit_engine(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw)
    again = None if timed else _fastest_when_lean(model_cfg, asked, picked, batch_rows, seq_len, kw, speeds,
                                                 mix)
    if again is not None:  # the host's lean layout made room for layouts to time: the fastest of them
        picked, fast = again
        said = [fast] + [w for w in said if not w.startswith("GPU memory is short")]
    else:
        said = [w for w in (fast, fewer_kept, auto) if w] + said
    keeps = engine_cfg.keep_residuals and kept_bytes(model_cfg, engine_cfg, 1, 1, assumes_flash(model_cfg)) > 0
    if keeps and not plan(model_cfg, picked, batch_rows, seq_len, detect=False, **kw).fits:
        # the kept attention residuals are one more activation per block: without them attention is
        # recomputed in the backward (slower), and the blocks' inputs may fit where both do not
        recompute = dataclasses.replace(engine_cfg, keep_residuals=False)
        plain, plain_said = _fit_engine(model_cfg, recompute, batch_rows, seq_len, disk_dir, kw)
        if plan(model_cfg, plain, batch_rows, seq_len, detect=False, **kw).fits:
            return plain, "; ".join(["keeping attention's output for the backward does not fit: attention is "
                                     "recomputed in the backward (engine.keep_residuals=false)"] + plain_said)
    return picked, ("; ".join(said) or None)


def _fastest_when_lean(model_cfg, asked: EngineConfig, picked: EngineConfig, batch_rows, seq_len, kw,
                       speeds: Speeds | None, mix: RowMix | None) -> tuple[EngineConfig, str] | None:
    """Where ``fastest`` timed nothing because no layout fit the host as configured, and the host's lean layout
    (``_fit_engine``: float32 streamed, gradients waiting on the GPU, ...) was then made for the most resident
    blocks: ``fastest`` again with that lean host layout and the "auto" fields as asked, on the host less
    ``LEAN_HOST_MARGIN``, so that the layout is the fastest that fits with the lean pick's margin rather than the
    one with the most resident blocks. None where there is nothing to pick again (no "auto" field, no rates, the
    host layout unchanged) or no layout fits so (activations offloaded, say): the pick stands."""
    autos = {f: getattr(asked, f) for f in ("resident_layers", "kept_layers", "gpu_updated_layers")
             if getattr(asked, f) == AUTO}
    layout = ("resident_layers", "kept_layers", "gpu_updated_layers", "offload_activations", "resident_copy",
              "prefetch_depth", "disk_dir")  # the GPU side's picks (as asked again), and where the disk tier would go
    lean_changed = any(getattr(picked, f.name) != getattr(asked, f.name) for f in dataclasses.fields(asked)
                       if f.name not in layout)
    if speeds is None or not autos or not lean_changed or kw.get("gpu_bytes") is None:
        return None
    retry = dataclasses.replace(picked, **autos, offload_activations=asked.offload_activations,
                                resident_copy=asked.resident_copy, prefetch_depth=asked.prefetch_depth)
    # timed against the host less the lean pick's margin, as the lean layout itself was picked where it could be:
    # a layout that fills the host to the last GiB is not one a run should end in (LEAN_HOST_MARGIN)
    room = dict(kw, host_ram_bytes=int(kw["host_ram_bytes"] * (1 - LEAN_HOST_MARGIN))) if kw.get(
        "host_ram_bytes") is not None else kw
    best, said = fastest(model_cfg, retry, batch_rows, seq_len, speeds, mix, **room)
    if said is None or AUTO in (best.resident_layers, best.kept_layers, best.gpu_updated_layers):
        return None
    return best, said


# ---------------------------------------------------------------------------------------------- legality
def legal(p: MemoryPlan, changes: Changes) -> bool:
    """Whether the engine config takes ``changes`` to ``p``'s (with a ``model.layers`` among them, for that
    many blocks): its constructor, its check of the per-block counts and the parts each role names raise
    ValueError for a combination the engine refuses."""
    engine = {key.removeprefix("engine."): value for key, value in changes if key.startswith("engine.")}
    layers = dict(changes).get("model.layers", p.model_cfg.layers)
    try:
        e = dataclasses.replace(p.engine_cfg, **engine)
        e.check_layers(layers)
    except ValueError:
        return False
    return _takes(layers, e)


def _takes(layers: int, e: EngineConfig) -> bool:
    """Whether the engine takes the roles ``e`` names for a model of ``layers`` blocks (``parts.HostRoles``)."""
    try:
        HostRoles.of_config(layers, e)
    except ValueError:
        return False
    return True


def fits(p: MemoryPlan, changes: Changes) -> bool:
    """Whether the plan with ``changes`` fits; a combination the engine refuses does not."""
    try:
        return p.applied(changes).fits
    except ValueError:
        return False


def fewest(p: MemoryPlan, key: str, values: list[int], gpu: bool = False) -> Changes | None:
    """The smallest of ``values`` for ``key`` whose plan fits the host (more of it, less host memory), or with
    ``gpu`` the GPU (more of it, less GPU memory), if that plan fits everything; values the config refuses are
    not tried."""
    best = _first_fitting(p, key, values, gpu)
    return best if best is not None and p.applied(best).fits else None


def _first_fitting(p: MemoryPlan, key: str, values: list[int], gpu: bool) -> Changes | None:
    """The smallest of ``values`` for ``key`` (those the config takes) whose plan fits the host (with ``gpu``:
    the GPU), bisected: more of it takes less of that memory."""
    values = [v for v in values if legal(p, ((key, v),))]
    lo, hi = 0, len(values)
    while lo < hi:  # lo: the first value whose plan fits
        mid = (lo + hi) // 2
        q = p.applied(((key, values[mid]),))
        lo, hi = (lo, mid) if (q.gpu_fits if gpu else q.host_fits) else (mid + 1, hi)
    return ((key, values[lo]),) if lo < len(values) else None


def most_fitting(fits_: Callable[[int], bool], hi: int) -> int:
    """The largest ``n`` in 0..``hi`` with ``fits_(n)``, bisected (GPU memory grows with ``n``); 0 where none
    above 0 fits."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits_(mid) else (lo, mid - 1)
    return lo


# ---------------------------------------------------------------------------------------------- the GPU
def offload_counts(p: MemoryPlan) -> list[int]:
    """The ``engine.offload_activations`` values above this run's that offload more blocks and that the
    config takes (the offloaded blocks must not meet the kept ones)."""
    e, layers = p.engine_cfg, p.model_cfg.layers
    most = offloaded_blocks(layers, e.prefetch_depth, layers)  # past it, no more blocks are offloaded
    return [n for n in range(e.offload_activations + 1, most + 1)
            if legal(p, (("engine.offload_activations", n),))]


def offload(p: MemoryPlan) -> Changes | None:
    """For a run that does not fit the GPU: the fewest blocks whose inputs wait in host memory
    (``engine.offload_activations``) that make the GPU fit, whether or not the host then fits (more
    host RAM: ``resolve`` then makes the host lean where it can); None where the GPU fits already or
    no count makes it fit."""
    if p.gpu_fits or p.gpu_available is None:
        return None
    return _first_fitting(p, "engine.offload_activations", offload_counts(p), gpu=True)


def fewer_fetched_ahead(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                        **plan_kw) -> tuple[EngineConfig, str | None]:
    """For a run whose GPU is short with ``prefetch_depth`` blocks fetched ahead: the most blocks ahead, down to
    one, with which it fits the GPU as configured (each one less holds one streamed block's weights less, and
    moves no byte more over PCIe, where offloading activations would). The config as given where it fits, where
    nothing is fetched ahead beyond one, or where even one ahead does not fit (offloading activations is then
    tried at the depth given). Returns the config and a sentence (None: as given)."""
    depth = engine_cfg.prefetch_depth
    p = plan(model_cfg, engine_cfg, batch_rows, seq_len, detect=False, **plan_kw)
    if depth <= 1 or p.gpu_fits or p.gpu_available is None:
        return engine_cfg, None
    changes = _first_fitting(p, "engine.prefetch_depth", list(range(depth - 1, 0, -1)), gpu=True)  # fewer: less
    if changes is None:
        return engine_cfg, None
    d, after = changes[0][1], p.applied(changes)
    return dataclasses.replace(engine_cfg, prefetch_depth=d), (
        f"GPU memory is short for {depth} blocks fetched ahead: {d} (engine.prefetch_depth={d}; GPU "
        f"{after.gpu_total / GiB:.1f} GiB of {after.gpu_available / GiB:.1f}; each block's forward may then wait "
        f"for its copy)")


def most_kept(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
              **plan_kw) -> tuple[EngineConfig, str | None]:
    """``kept_layers`` as configured where the GPU fits it (with ``resident_layers="auto"``: with no block
    resident, which is then picked around it), else the most blocks keeping their matrix products that fit,
    down to none; no activation offload is picked before these are given up. Returns the config and a
    sentence (None: as configured)."""
    if not engine_cfg.kept_layers or plan_kw.get("gpu_bytes") is None:
        return engine_cfg, None
    base = engine_cfg if engine_cfg.resident_layers != AUTO else dataclasses.replace(engine_cfg, resident_layers=0)
    with_ = lambda k: dataclasses.replace(base, kept_layers=k)  # noqa: E731
    gpu_fits = lambda k: plan(model_cfg, with_(k), batch_rows, seq_len, detect=False, **plan_kw).gpu_fits  # noqa: E731
    if gpu_fits(engine_cfg.kept_layers):
        return engine_cfg, None
    lo = most_fitting(gpu_fits, engine_cfg.kept_layers - 1)  # none, where not even 0 fits: nothing else to give up
    p = plan(model_cfg, with_(lo), batch_rows, seq_len, detect=False, **plan_kw)
    return dataclasses.replace(engine_cfg, kept_layers=lo), (
        f"GPU memory is short for engine.kept_layers={engine_cfg.kept_layers}: the last {lo} blocks keep their "
        f"matrix products for the backward (engine.kept_layers={lo}; GPU {p.gpu_total / GiB:.1f} GiB of "
        f"{p.gpu_available / GiB:.1f})")


def most_resident(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                  **plan_kw) -> tuple[EngineConfig, str | None]:
    """``resident_layers="auto"`` made a number: the most blocks kept on the GPU (with their optimizer
    state, updated there: no host update and no transfer for them) that the plan fits in GPU memory with its
    margin, of those the config takes (the io part as configured, the blocks that ``grads_on_gpu`` and
    ``disk_parts`` name left host-updated). 0 where the config takes none (capacity mode updates every part on
    the host), with no GPU to plan for, or with the GPU full without any. Returns the config and a sentence
    (None: the config did not ask)."""
    if engine_cfg.resident_layers != AUTO:
        return engine_cfg, None
    with_ = lambda r: dataclasses.replace(engine_cfg, resident_layers=r)  # noqa: E731
    hi, refused = _most_taken(model_cfg, engine_cfg)
    if hi == 0 and refused is not None:
        return with_(0), f"engine.resident_layers='auto': 0 (the engine takes no GPU-resident block here: {refused})"
    if plan_kw.get("gpu_bytes") is None:
        return with_(0), "engine.resident_layers='auto': 0 (no GPU to plan for)"
    gpu_fits = lambda r: plan(model_cfg, with_(r), batch_rows, seq_len, detect=False, **plan_kw).gpu_fits  # noqa: E731
    if not gpu_fits(0):
        return with_(0), "engine.resident_layers='auto': 0 (the GPU is full without any)"
    lo = most_fitting(gpu_fits, hi)
    p = plan(model_cfg, with_(lo), batch_rows, seq_len, detect=False, **plan_kw)
    return with_(lo), (f"engine.resident_layers='auto': {lo} of {model_cfg.layers} blocks GPU-resident, the most "
                       f"that fit (GPU {p.gpu_total / GiB:.1f} GiB of {p.gpu_available / GiB:.1f}; they update on the "
                       f"GPU, with no host update or transfer)")


def _most_taken(model_cfg: DecoderConfig, engine_cfg: EngineConfig) -> tuple[int, ValueError | None]:
    """The most GPU-resident blocks the config takes (the parts ``grads_on_gpu`` and ``disk_parts`` name stay
    host-updated), and why more are refused (None: every block may be)."""
    n, hi, refused = model_cfg.layers, model_cfg.layers, None
    while hi > 0:
        try:
            e = dataclasses.replace(engine_cfg, resident_layers=hi)
            HostRoles.of_config(n, e)
            break
        except ValueError as err:
            refused, hi = err, hi - 1
    return hi, refused


def fastest(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int, speeds: Speeds,
            mix: RowMix | None = None, **plan_kw) -> tuple[EngineConfig, str | None]:
    """``resident_layers`` and ``kept_layers``, where either is "auto", for the GPU of ``speeds``: of the layouts
    whose plan fits the GPU (each count of resident blocks the config takes, or the one it names; beside it the
    most blocks keeping their matrix products that fit, or the count it names), the one the step-time model
    (``step_time.predict``) finds fastest among those that fit the host too; the fewest resident blocks among
    equals. Where ``resident_copy`` is "auto" too and the resident parts have a compute copy to keep, each layout
    is tried with the copies kept and cast at each fetch (which leaves room for more blocks); kept among equals.
    Where ``gpu_updated_layers`` is "auto" (and the mode keeps float32 state), beside each count of resident
    blocks each count of the blocks after them updated on the GPU is tried, from none up, until one does not fit
    or two in a row are slower than the best of that count of resident blocks; the fewest among equals.
    Where none fits host and GPU as configured, or there is no GPU to plan for, the config comes back
    as given ("auto" fields and all) for the pickers after it (the most resident blocks, offload, the lean
    host layout). ``mix``: what the rows hold, for the step-time model (``step_time.predict``).
    Returns the config and a sentence (None: as given)."""
    auto_r, auto_k = engine_cfg.resident_layers == AUTO, engine_cfg.kept_layers == AUTO
    auto_g = engine_cfg.gpu_updated_layers == AUTO
    mode = precision.mode_of(engine_cfg, model_cfg.dtype)
    can_g = auto_g and not mode.stochastic and not engine_cfg.norm_first  # the GPU's update keeps float32 state
    # the resident parts' compute copy, kept or cast at each fetch, where there is one to choose
    auto_c = engine_cfg.resident_copy == AUTO and mode.stream_copy and (
        auto_r or engine_cfg.resident_layers or engine_cfg.resident_io)
    zero = dataclasses.replace(engine_cfg, **({"resident_layers": 0} if auto_r else {}),
                               **({"kept_layers": 0} if auto_k else {}), **({"gpu_updated_layers": 0} if auto_g else {}))
    if plan_kw.get("gpu_bytes") is None:
        return engine_cfg, None
    if not (auto_r or auto_k or can_g):  # only gpu_updated_layers asked, and the mode cannot take it: none
        return zero, None
    planned = lambda e: plan(model_cfg, e, batch_rows, seq_len, detect=False, **plan_kw)  # noqa: E731
    gpu_fits = lambda e: planned(e).gpu_fits  # noqa: E731
    layers = model_cfg.layers
    most_kept_ = layers - offloaded_blocks(layers, engine_cfg.prefetch_depth, engine_cfg.offload_activations)
    tried: list[tuple[float, EngineConfig, MemoryPlan]] = []
    for copy in ((True, False) if auto_c else (engine_cfg.resident_copy,)):
        with_copy = dataclasses.replace(zero, resident_copy=copy)
        most_r = most_kept_  # the kept blocks that fit beside one more resident block: at most this count's
        for r in (range(_most_taken(model_cfg, engine_cfg)[0] + 1) if auto_r else [engine_cfg.resident_layers]):
            base = dataclasses.replace(with_copy, resident_layers=r)
            if not gpu_fits(base):
                break  # more resident blocks take more GPU memory
            best_here, slower, most_k = None, 0, most_r
            for g in (range(layers - r + 1) if can_g else [base.gpu_updated_layers]):
                cand = dataclasses.replace(base, gpu_updated_layers=g)
                if g and not (_takes(layers, cand) and gpu_fits(cand)):
                    break  # more blocks updated on the GPU take more GPU memory
                if auto_k:  # more blocks updated on the GPU leave no more room: at most the last count's
                    k = most_k = most_fitting(lambda k: gpu_fits(dataclasses.replace(cand, kept_layers=k)), most_k)
                    most_r = k if g == 0 else most_r
                    cand = dataclasses.replace(cand, kept_layers=k)
                p = planned(cand)
                if not p.fits:  # the host too (more resident blocks, less host memory)
                    continue
                seconds = predict(model_cfg, cand, batch_rows, seq_len, speeds, devices=plan_kw.get("devices", 1),
                                  mix=mix).seconds
                tried.append((seconds, cand, p))
                if best_here is None or seconds < best_here:
                    best_here, slower = seconds, 0
                elif (slower := slower + 1) >= 2:
                    break
    if not tried:
        return engine_cfg, None
    seconds, best, p = min(tried, key=lambda t: t[0])  # the first of equals: copies kept, the fewest resident
    most = max(tried, key=lambda t: (t[1].resident_layers, t[1].resident_copy is not False))
    asked = " and ".join(f"engine.{f}='auto'" for f, a in (("resident_layers", auto_r), ("kept_layers", auto_k),
                                                          ("resident_copy", auto_c), ("gpu_updated_layers", can_g)) if a)
    versus = ("" if most[1] == best or not auto_r else f"; the most resident blocks that fit, {most[1].resident_layers}"
              + (f" with {most[1].kept_layers} keeping products" if auto_k else "") + f", {most[0]:.2f} s")
    split = "every host update split" if best.split_parts == AUTO else f"split_parts={best.split_parts}"
    copies = "" if not auto_c else (", their compute copies kept" if best.resident_copy else
                                    ", their compute copies cast at each fetch (2 B/param less on the GPU)")
    visiting = "" if not can_g else (f", the next {best.gpu_updated_layers} streamed but updated on the GPU"
                                     if best.gpu_updated_layers else ", none updated on the GPU")
    return best, (f"{asked}: {best.resident_layers} of {layers} blocks GPU-resident{copies}{visiting}, the last "
                  f"{best.kept_layers} keeping their matrix products for the backward: the fastest of "
                  f"{len(tried)} layout{'s' if len(tried) > 1 else ''} that fit by the step-time model "
                  f"({seconds:.2f} s per step with {split}, at {speeds.name}{versus}; GPU {p.gpu_total / GiB:.1f} GiB of "
                  f"{p.gpu_available / GiB:.1f})")


def _fit_engine(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw) -> tuple[EngineConfig, list[str]]:
    """``resolve`` for one setting of ``keep_residuals``: the config, and what was picked in words."""
    user_host = (engine_cfg.stream_dtype is not None or engine_cfg.grads_on_gpu or engine_cfg.disk_parts
                 or engine_cfg.norm_first)
    said = []
    engine_cfg, fewer_ahead = fewer_fetched_ahead(model_cfg, engine_cfg, batch_rows, seq_len, **kw)
    said += [fewer_ahead] if fewer_ahead else []
    if not engine_cfg.offload_activations:
        p = plan(model_cfg, engine_cfg, batch_rows, seq_len, detect=False, **kw)
        changes = offload(p)
        # the fewest offloaded blocks for the GPU; their host RAM may call for the lean host layout, whose
        # gradients on the GPU may in turn call for a few blocks more
        for n in ([] if changes is None else [n for n in offload_counts(p) if n >= changes[0][1]]):
            offloaded, words = dataclasses.replace(engine_cfg, offload_activations=n), None
            if not user_host:
                offloaded, words = _lean_host(model_cfg, offloaded, batch_rows, seq_len, disk_dir=disk_dir, **kw)
            after = plan(model_cfg, offloaded, batch_rows, seq_len, detect=False, **kw)
            if after.fits:
                engine_cfg = offloaded
                what = "inputs" if not kept_bytes(model_cfg, offloaded, 1, 1, assumes_flash(model_cfg)) else \
                    "inputs and kept attention residuals"
                said.append(f"GPU memory is short ({p.gpu_total / GiB:.1f} GiB needed, {p.gpu_available / GiB:.1f} "
                            f"available): the {what} of the first {n} blocks wait in host memory between forward "
                            f"and backward (engine.offload_activations={n}; GPU {after.gpu_total / GiB:.1f} GiB)")
                said += [words] if words else []
                break
    if not user_host:
        engine_cfg, words = _lean_host(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir=disk_dir, **kw)
        said += [words] if words else []
    return engine_cfg, said


# ---------------------------------------------------------------------------------------------- host RAM
def lean(p: MemoryPlan) -> Changes | None:
    """Full precision in less host RAM, for a run that does not fit the host: the float32 masters are
    streamed (no 16-bit host copy), and if that is not enough, the fewest parts' gradients wait on the
    GPU (with ``LEAN_HOST_MARGIN`` of the host left over where possible, then without), and if that is not
    enough, the two-pass step (``norm_first``: a step's gradients never all in host memory, for a second
    backward; with the fewest blocks' inputs in host memory where the GPU needs it). In capacity mode, where
    that does not fit even without the margin: 8-bit moments and bfloat16 gradients (``_leanest_lower``), so that the
    lower precision is picked only where capacity mode's own does not fit. Then (with a ``disk_dir``) the
    fewest blocks' moments in the disk tier: last, because it reads and writes their moments every step
    (at 70B, hundreds of GB per step through the disk), where 8-bit moments cost no time. The changes, or
    None where the run fits already or even this does not fit."""
    if p.host_fits:
        return None
    plans = [p] if p.host_available is None else [
        p.replace(host_ram_bytes=int(p.host_available * (1 - LEAN_HOST_MARGIN))), p]
    for leanest in (lambda q: _leanest(q, disk=False, two_pass=False), lambda q: _leanest(q, disk=False),
                    _leanest_lower, _leanest):
        for q in plans:
            changes = leanest(q)
            if changes is not None:
                return changes
    return None


def _leanest(p: MemoryPlan, disk: bool = True, two_pass: bool = True) -> Changes | None:
    # the masters streamed instead of a 16-bit copy of them, where the mode has that layout and the config takes it
    masters = [precision.switch(p.engine_cfg, m, p.stream_dtype) for m in precision.layouts(p.mode)
               if not m.stream_copy]
    stream = masters[0] if masters and legal(p, masters[0]) else ()
    streamed = p.applied(stream)
    if streamed.host_fits:
        return stream if streamed.fits else None
    n_host = len(host_roles(p.model_cfg, p.engine_cfg).host_updated)
    grads = fewest(streamed, "engine.grads_on_gpu", list(range(1, n_host + 1)))
    if grads is not None:
        return stream + grads
    # the two-pass step: exact; its second backward costs time, not precision. Its first pass holds every block's
    # inputs through both backwards: where the GPU is short of room for them, the fewest blocks' wait in host memory
    if two_pass and not p.engine_cfg.norm_first:
        two = (("engine.norm_first", True),)
        if fits(streamed, two):
            return stream + two
        if legal(streamed, two) and streamed.applied(two).host_fits:
            off = _first_fitting(streamed.applied(two), "engine.offload_activations",
                                 offload_counts(streamed.applied(two)), gpu=True)
            if off is not None and fits(streamed, two + off):
                return stream + two + off
    if disk and not p.engine_cfg.disk_parts:  # the last blocks' moments on disk, where the config takes it
        blocks = p.model_cfg.layers - p.engine_cfg.resident_layers
        on_disk = fewest(streamed, "engine.disk_parts", list(range(1, blocks + 1)))
        return None if on_disk is None else stream + on_disk
    return None


def _leanest_lower(p: MemoryPlan) -> Changes | None:
    """The first mode below ``p``'s that keeps its masters' dtype (capacity mode's: 8-bit moments and bfloat16
    gradients in host memory, then 7-bit m with 5-bit v) and fits with the leanest layout of
    its own (``_leanest``: gradients on the GPU, the two-pass step, the disk tier where the mode has one); None
    where there is none (below full precision the masters change: opt-in), the config does not take one, or
    nothing fits."""
    for mode in (m for m in precision.lower(p.mode) if m.masters == p.mode.masters):  # 8-bit, then m7v5
        changes = precision.switch(p.engine_cfg, mode, p.stream_dtype)
        if not legal(p, changes):
            continue
        rest = _leanest(p.applied(changes))
        if rest is not None:
            return changes + rest
    return None


def _lean_host(model_cfg, engine_cfg, batch_rows, seq_len, *, host_ram_bytes, gpu_bytes, disk_dir=None,
               **plan_kw) -> tuple[EngineConfig, str | None]:
    """``resolve``'s host part: the lean layout that fits the host (``lean``), and the words."""
    given = engine_cfg
    if disk_dir is not None and engine_cfg.disk_dir is None:
        engine_cfg = dataclasses.replace(engine_cfg, disk_dir=str(disk_dir))
    plan_kw.setdefault("disk_bytes", available_disk_bytes(engine_cfg.disk_dir))
    p = plan(model_cfg, engine_cfg, batch_rows, seq_len, host_ram_bytes=host_ram_bytes, gpu_bytes=gpu_bytes,
             detect=False, **plan_kw)
    changes = lean(p)
    if changes is None:
        return given, None
    leaner = p.applied(changes)
    if not leaner.engine_cfg.disk_parts:  # the disk folder is the config's only where the tier is used
        leaner = leaner.replace(engine_cfg=dataclasses.replace(leaner.engine_cfg, disk_dir=given.disk_dir))
    said = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes)
    if leaner.engine_cfg.norm_first and not p.engine_cfg.norm_first:
        said += (" (a forward and two backwards per step, the same numbers: the first backward takes the global "
                 "norm, the second updates each part as its gradient comes home, so host memory holds no step's "
                 "gradients)")
    if leaner.engine_cfg.offload_activations > p.engine_cfg.offload_activations:
        said += (f" (the inputs of the first {leaner.engine_cfg.offload_activations} blocks wait in host memory "
                 f"between the forward and the backwards: the GPU holds the others' through both)")
    mode = leaner.mode
    if mode is not p.mode and mode.stochastic:
        said = f"{mode.summary} ({said}; {mode.quality})"
    if leaner.engine_cfg.disk_parts:
        said += (f" (engine.disk_dir={leaner.engine_cfg.disk_dir}: {leaner.disk / GiB:.1f} GiB of Adam moments in "
                 f"files, read and written once per step)")
    return leaner.engine_cfg, (f"host RAM is short ({p.host_total / GiB:.1f} GiB needed, "
                               f"{p.host_available / GiB:.1f} available): running {mode.title}: "
                               f"{said}, {leaner.host_total / leaner.params:.1f} host bytes per parameter instead of "
                               f"{p.host_total / p.params:.1f} ({leaner.host_total / GiB:.1f} GiB)")


# ---------------------------------------------------------------------------------------------- XLA's figures
def exact_plan(model, estimate: MemoryPlan, *, given: EngineConfig, devices: int | None, disk_dir: str,
               check: bool = True, speeds: Speeds | None = None,
               mix: RowMix | None = None) -> tuple[MemoryPlan, str | None]:
    """The plan with XLA's memory analysis of the run's compiled programs in place of the rules of thumb
    (``megatrain_jax.engine.program_memory``; the first step then finds them compiled; ``model``: the abstract
    model). Where that does not fit and ``check``, the layout is picked again from the ``given`` config with
    XLA's figures (activations offloaded, gradients moved) and those programs planned; returns the plan and
    what was picked again (None: the layout stands; ``speeds``: the GPU's rates, as ``resolve`` had them, so
    that "auto" fields are picked again for speed, with what the rows hold, ``mix``). Whether the result fits
    is the caller's to check. Needs the GPU at hand."""
    from megatrain_jax.engine.program_memory import program_memory
    from megatrain_jax.engine.transfer import Placement, select_devices
    e = estimate
    placement = Placement(select_devices(devices))
    measure = lambda cfg: program_memory(model, cfg, e.batch_rows, e.seq_len, packed=e.packed,  # noqa: E731
                                         placement=placement)
    exact = e.replace(programs=measure(e.engine_cfg))
    if exact.fits or not check:
        return exact, None
    engine_cfg, said = lean_engine(e.model_cfg, given, e.batch_rows, e.seq_len, host_ram_bytes=e.host_available,
                                   gpu_bytes=e.gpu_available, disk_dir=disk_dir, packed=e.packed, devices=e.devices,
                                   programs=exact.programs, speeds=speeds, mix=mix,
                                   export=e.export, checkpoints=e.checkpoints)  # the run's end, as the plan counts it
    if engine_cfg == e.engine_cfg:
        return exact, None
    again = e.replace(engine_cfg=engine_cfg, programs=exact.programs)
    if not again.gpu_exact:  # the programs changed (kept residuals dropped): their own figures
        again = again.replace(programs=measure(engine_cfg))
    changed = ", ".join(f"engine.{f.name}={getattr(engine_cfg, f.name)}" for f in dataclasses.fields(engine_cfg)
                        if getattr(engine_cfg, f.name) != getattr(e.engine_cfg, f.name))
    return again, (f"with XLA's figures for the compiled programs the layout picked from the estimate needs "
                   f"{exact.gpu_total / GiB:.1f} GiB of GPU memory and does not fit in {e.gpu_available / GiB:.1f} "
                   f"(less a {GPU_FRAGMENTATION_MARGIN / GiB:.1f} GiB margin): picked again, {changed}"
                   + (f" ({said})" if said else ""))
