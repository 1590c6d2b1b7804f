"""What fits instead: for a run whose plan does not fit, the changes to its config that do (each re-planned),
the words that explain them, and what machine it needs as configured. What ``train`` runs is ``layout.resolve``'s job.

The levers are listed fastest first (``_levers``): kept blocks, GPU-resident blocks, resident io, the stream
dtype, the disk tier, gradients waiting on the GPU, the two-pass step (``norm_first``), capacity mode, capacity
mode with 8-bit (then m7v5's) moments and bfloat16 gradients, kept attention residuals, activation
offload, micro-batches, prefetch depth, fewer rows with more accumulation, shorter sequences, and last a smaller
model. Each search re-plans with ``MemoryPlan.applied``; where memory is monotone in a lever's value, the search bisects. A lever offers only
the values the engine config takes (``layout.legal``): the config is the judge of what combines. A leaner
precision mode that fits the host but leaves the GPU short comes with the first GPU lever that closes the gap
(``_with_gpu_lever``: kept attention residuals, activation offload, micro-batches, prefetch depth).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator

from megatrain_jax.engine.config import AUTO, EngineConfig
from megatrain_jax.engine.parts import part_ids
from megatrain_jax.engine.schedule import UPDATES_AHEAD, offloaded_blocks
from megatrain_jax.plan.activations import assumes_flash, kept_bytes
from megatrain_jax.engine import precision
from megatrain_jax.plan.counts import (GiB, activation_bytes, host_grad_bytes, host_roles, layer_param_count,
                                      mode_moment_bytes)
from megatrain_jax._environment import gpu_fraction_var
from megatrain_jax.plan.machine import gpu_fraction
from megatrain_jax.plan.memory import MemoryPlan, MemoryPlanError
from megatrain_jax.plan.layout import Changes, fewest, fits, legal, offload_counts
from megatrain_jax.plan.modes import InMode, host_gib_needed, in_each_mode, leanest, modes_table


# ---------------------------------------------------------------------------------------------- options
@dataclasses.dataclass(frozen=True)
class Option:
    """A change to the run's config that was re-planned and fits: ``changes`` as (``section.key``, value)
    pairs, ``why`` says what it changes and what it costs in speed."""

    changes: Changes
    why: str

    @property
    def overrides(self) -> list[str]:
        """The changes as command-line overrides (``megatrain-jax train ... engine.micro_batches=4``)."""
        text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
        return [f"{key}={text(value)}" for key, value in self.changes]

    def __str__(self) -> str:
        return f"{' '.join(self.overrides)}: {self.why}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _stored_per_param(c, mode: precision.Precision) -> float:
    """Host bytes per parameter of ``mode``'s masters and moments for the model ``c`` (8-bit moments are
    counted leaf by leaf: only called when an option's words are asked for)."""
    moments = sum(mode_moment_bytes(c, mode, part) for part in part_ids(c.layers))
    return mode.master_bytes + moments / c.param_count()


def _stream_words(mode: precision.Precision, other: precision.Precision) -> str:
    """What switching from ``mode`` to ``other``, which streams otherwise, changes."""
    copy = other.bytes_per_param()["stream_copy"] - mode.bytes_per_param()["stream_copy"]
    pcie = other.to_gpu_bytes / mode.to_gpu_bytes
    if copy < 0:
        return (f"stream the {other.masters} masters: no 16-bit host copy ({-copy} B/param less host RAM), {pcie:g}x "
                f"the bytes per layer over PCIe (hidden behind compute from about 16K tokens per layer visit on an "
                f"H100)")
    return (f"stream {other.to_gpu_bytes * 8}-bit weights: {pcie:g}x the PCIe bytes (faster); the host keeps a "
            f"16-bit copy (+{copy} B/param)")


def _levers(p: MemoryPlan) -> Iterator[tuple[str, list[Changes], Callable]]:
    """Each lever: its name, candidate changes fastest first (those the engine config takes), and the words
    for a chosen change."""
    e, c, rows, seq = p.engine_cfg, p.model_cfg, p.batch_rows, p.seq_len
    takes = lambda candidates: [ch for ch in candidates if legal(p, ch)]  # noqa: E731
    if e.kept_layers:  # first: it costs only the recompute it saved
        yield ("kept", [(("engine.kept_layers", k),) for k in range(e.kept_layers - 1, -1, -1)],
               lambda ch: (f"the last {ch[0][1]} blocks keep their matrix products for the backward instead of "
                           f"{e.kept_layers} (the others recompute them: slower)"))
    if e.keeps_resident_copy and (e.resident_layers or e.resident_io) and p.mode.stream_copy:  # cheap: a cast
        yield ("copy", takes([(("engine.resident_copy", False),)]),
               lambda ch: ("the GPU-resident parts cast their bfloat16 compute copy from their masters at each fetch "
                           "instead of keeping it (2 B/param less GPU memory; a cast of 6 B/param of GPU memory "
                           "traffic at each fetch: slightly slower)"))
    resident = takes((("engine.resident_layers", r),) for r in range(c.layers, -1, -1) if r != e.resident_layers)
    yield ("resident", resident,
           lambda ch: (f"{ch[0][1]} GPU-resident blocks instead of {e.resident_layers}: " +
                       ("fewer blocks update on the GPU, so the next forward may wait on the host optimizer "
                        "(slower)" if ch[0][1] < e.resident_layers else
                        f"their gradients stay on the GPU ({host_grad_bytes(e)} B/param less host RAM) and they "
                        f"update there (faster)")))
    yield ("resident_io", takes([(("engine.resident_io", not e.resident_io),)]),
           lambda ch: "io part (embedding, head) " + ("kept on the GPU (faster)" if ch[0][1] else
                                                      "streamed instead of GPU-resident (slower first block)"))
    mode = p.mode
    for other in precision.layouts(mode):  # full precision's other host layout: what crosses PCIe
        yield ("stream", takes([precision.switch(e, other, p.stream_dtype)]),
               lambda ch, other=other: _stream_words(mode, other))
    gib = lambda n: n * layer_param_count(c) * mode.moment_bytes / GiB  # noqa: E731
    yield ("disk", takes((("engine.disk_parts", n),) for n in range(1, c.layers + 1) if n != e.disk_parts),
           lambda ch: (f"the Adam moments of the last {ch[0][1]} blocks in files under {e.disk_dir} "
                       f"({gib(ch[0][1]):.1f} GiB, read and written once per step: slower unless the disk "
                       f"keeps up with the host optimizer)"))
    n_host = len(host_roles(c, e).host_updated)
    yield ("grads_on_gpu",
           takes((("engine.grads_on_gpu", n),) for n in range(1, n_host + 1) if n != e.grads_on_gpu),
           lambda ch: (f"the float32 gradients of {ch[0][1]} parts wait on the GPU for the global norm instead of "
                       f"in host memory ({host_grad_bytes(e)} B/param less host RAM for them, 4 B/param more GPU "
                       f"memory); each comes home when its update runs"))
    if not e.norm_first:
        two_pass = (("engine.norm_first", True),) + ((("engine.grads_on_gpu", 0),) if e.grads_on_gpu else ()) + (
            (("engine.gpu_updated_layers", 0),) if e.gpu_updated_layers not in (0, AUTO) else ()) + (
            (("engine.gpu_updated_io", False),) if e.gpu_updated_io is True else ())
        # its first pass holds every block's inputs through both backwards: where the GPU is short of them, the
        # first blocks' wait in host memory (fewest first)
        offloaded = [two_pass + (("engine.offload_activations", n),) for n in offload_counts(p)]
        yield ("norm_first", takes([two_pass, *offloaded]),
               lambda ch: (f"a forward and two backwards per step, the same numbers: the first backward takes the "
                           f"global norm on the GPU, the second updates each part as its gradient comes home, so host "
                           f"memory holds {UPDATES_AHEAD + 1} parts' gradients instead of a step's "
                           f"({(p.host_total - p.applied(ch).host_total) / GiB:.1f} GiB less); the second backward "
                           f"costs GPU time and PCIe (slower, least where the host update bounds the step), and the "
                           f"GPU holds every block's inputs through both backwards" + (
                               f" (those of the first {dict(ch)['engine.offload_activations']} blocks wait in host "
                               f"memory)" if "engine.offload_activations" in dict(ch) else "")))
    on_host = "; every part updates on the host" if e.resident_layers or e.resident_io else ""
    for lower in precision.lower(mode):  # the modes that store less, each with what comes with it
        yield (lower.name, takes([precision.switch(e, lower, p.stream_dtype)]),
               lambda ch, lower=lower: (
                   f"{lower.title}: {lower.summary} (about {_stored_per_param(c, lower):.1f} B/param of masters "
                   f"and moments instead of {_stored_per_param(c, mode):.1f}, + " + _grads_words(e, lower)
                   + f"; {lower.quality})"
                   + on_host + ("; no disk tier" if e.disk_parts and not lower.disk_tier else "")))
    if e.keep_residuals and kept_bytes(c, e, 1, 1, assumes_flash(c)):
        yield ("keep", [(("engine.keep_residuals", False),)],
               lambda ch: ("attention is recomputed in the backward instead of kept from the forward: one "
                           "activation per block less, attention's forward twice per step (slower at long "
                           "sequences)"))
    act_gib = (rows * seq * c.hidden * activation_bytes(c)
               + kept_bytes(c, e, rows, seq, assumes_flash(c), p.packed)) / GiB
    yield ("offload", [(("engine.offload_activations", n),) for n in offload_counts(p)],
           lambda ch: (f"the inputs of the first {ch[0][1]} blocks wait in pinned host memory between forward and "
                       f"backward ({ch[0][1] * act_gib:.1f} GiB of host RAM), copied out and back behind the "
                       f"compute"))
    yield ("micro", [(("engine.micro_batches", m),) for m in _divisors(rows) if m > e.micro_batches],
           lambda ch: (f"{ch[0][1]} micro-batches of {rows // ch[0][1] * seq} tokens: smaller transients; "
                       f"below about 8K tokens per layer visit the weight transfers stop hiding behind compute"))
    yield ("prefetch", [(("engine.prefetch_depth", d),) for d in range(e.prefetch_depth - 1, 0, -1)],
           lambda ch: f"prefetch {ch[0][1]} block(s) ahead: fewer weights in flight; a slow host update "
                      f"or transfer is hidden less")
    fewer = []
    for k in (2, 4, 8, 16, 32):
        if rows % k == 0:
            r = rows // k
            m = max(d for d in _divisors(r) if d <= e.micro_batches)
            fewer.append((("data.batch_size", r), ("engine.accumulate_steps", e.accumulate_steps * k),
                          ("engine.micro_batches", m)))
    yield ("rows", takes(fewer),
           lambda ch: (f"{ch[0][1]} rows per pass, {ch[1][1]} passes per optimizer step (the same tokens per "
                       f"step): fewer boundary activations; the weights cross PCIe twice per pass, "
                       f"{ch[1][1] // e.accumulate_steps}x the transfers per step"))
    shorter = [(("data.seq_len", seq // k),) for k in (2, 4, 8, 16) if seq % k == 0 and seq // k >= 128]
    yield ("seq", shorter, lambda ch: f"sequences of {ch[0][1]} tokens: shorter context (changes what the model "
                                      f"learns) and fewer tokens per step")


def _first_fit(p: MemoryPlan, candidates: list[Changes]) -> Changes | None:
    """The first candidate that fits. More resident blocks need more GPU and less host memory, so that
    lever is bisected for the most blocks that fit the GPU; more gradients on the GPU need less host
    memory, so that one for the fewest that fit the host; the others have few candidates."""
    if candidates and candidates[0][0][0] in ("engine.grads_on_gpu", "engine.disk_parts"):
        return fewest(p, candidates[0][0][0], sorted(ch[0][1] for ch in candidates))
    if candidates and candidates[0][0][0] == "engine.offload_activations":
        return fewest(p, candidates[0][0][0], sorted(ch[0][1] for ch in candidates), gpu=True)
    if candidates and candidates[0][0][0] == "engine.resident_layers":
        values = sorted(ch[0][1] for ch in candidates)
        lo, hi = 0, len(values)
        while lo < hi:  # lo: how many values fit the GPU
            mid = (lo + hi) // 2
            ok = p.applied((("engine.resident_layers", values[mid]),)).gpu_fits
            lo, hi = (mid + 1, hi) if ok else (lo, mid)
        best = (("engine.resident_layers", values[lo - 1]),) if lo else None
        return best if best is not None and p.applied(best).fits else None
    return next((ch for ch in candidates if fits(p, ch)), None)


def options(p: MemoryPlan, given: EngineConfig | None = None) -> list[Option]:
    """Changes that make the run fit in both host and GPU memory, each re-planned: one lever at a time,
    and where none of those keeps full precision (capacity mode may fit alone), pairs of the other
    levers; a smaller model last. Empty when nothing of that kind fits.

    ``given`` is the engine as the config file sets it, where ``p`` plans the one ``train`` picked from it
    (``resolve``): the options are overrides of that file, so a smaller model also clips the file's
    per-block counts that the smaller model could not hold."""
    if p.fits:
        return []
    levers = sorted(_levers(p), key=lambda lever: lever[0] == "resident")  # resident last: bisected
    out = []
    for name, candidates, words in levers:
        ch = _first_fit(p, candidates)
        if ch is not None:
            out.append((name, Option(ch, words(ch))))
        elif name in precision.MODES and candidates:  # a leaner mode that fits the host but not the GPU
            paired = _with_gpu_lever(p, candidates[0], words)
            if paired is not None:
                out.append((name, paired))
    if all(name in precision.MODES for name, _ in out):  # nothing in this run's precision yet: pairs of levers
        levers = [lever for lever in levers if lever[0] not in precision.MODES]
        for i, (_, first, words1) in enumerate(levers):
            for name2, _, _ in levers[i + 1:]:
                for ch1 in _tried_first(first):
                    q = p.applied(ch1)  # the second lever's candidates are those valid after the first
                    _, second, words2 = next(lever for lever in _levers(q) if lever[0] == name2)
                    ch2 = _first_fit(q, [c for c in second if not any(k in dict(ch1) for k, _ in c)])
                    if ch2 is not None:
                        out.append(("pair", Option(ch1 + ch2, f"{words1(ch1)}; and {words2(ch2)}")))
                        break
    layers = next((n for n in range(p.model_cfg.layers - 1, 0, -1)
                   if p.applied(_smaller(p, n, given)).fits), None)
    if layers is not None:
        out.append(("smaller", Option(_smaller(p, layers, given), f"a smaller model of {layers} layers (the rest as "
                                                             f"configured)")))
    return [option for _, option in out]


def _grads_words(e: EngineConfig, mode: precision.Precision) -> str:
    """What a leaner mode's gradients take in host memory: a step's, or with the two-pass step only the parts'
    whose updates may be unfinished."""
    if e.norm_first:
        return f"{mode.host_grad_dtypes[0]} gradients of at most {UPDATES_AHEAD + 1} parts (the two-pass step)"
    return f"{mode.bytes_per_param()['host_grads']} B/param of gradients"


# The levers that lower the GPU's peak without touching the host's precision, in ``_levers``' order.
GPU_LEVERS = ("copy", "keep", "offload", "micro", "prefetch")


def _with_gpu_lever(p: MemoryPlan, switch: Changes, words: Callable) -> Option | None:
    """A precision mode's ``switch`` that fits the host but not the GPU, with the first GPU lever
    (``GPU_LEVERS``) that makes it fit both; None where the switch does not fit the host or no lever helps."""
    q = p.applied(switch)
    if not q.host_fits or q.gpu_fits:
        return None
    for name, candidates, more in _levers(q):
        if name in GPU_LEVERS:
            ch = _first_fit(q, [c for c in candidates if not any(k in dict(switch) for k, _ in c)])
            if ch is not None:
                return Option(switch + ch, f"{words(switch)}; and {more(ch)}")
    return None


def _tried_first(candidates: list[Changes], n: int = 6) -> list[Changes]:
    """The first lever's candidates a pair tries: the first ``n`` in the lever's order, except for the counts
    that only lower host memory the more there are (gradients waiting on the GPU, blocks' moments on disk),
    where ``n`` spread over the whole range, the largest included: the host may need more than the first few."""
    if candidates and candidates[0][0][0] in ("engine.grads_on_gpu", "engine.disk_parts") and len(candidates) > n:
        step = (len(candidates) - 1) / (n - 1)
        return [candidates[round(i * step)] for i in range(n)]
    return candidates[:n]


def _smaller(p: MemoryPlan, layers: int, given: EngineConfig | None = None) -> Changes:
    """A model of ``layers`` layers, and each per-block count of the planned engine clipped to what it can
    hold; a count that only the config file (``given``) sets past ``layers`` is written as planned, so that
    the overrides pass the file's checks and re-plan as this option was planned."""
    changes: Changes = (("model.layers", layers),)
    e = p.engine_cfg
    over = lambda name, limit: (getattr(e, name) > limit  # noqa: E731
                                or (given is not None and isinstance(getattr(given, name), int)
                                    and getattr(given, name) > limit))
    if over("resident_layers", layers):
        changes += (("engine.resident_layers", min(e.resident_layers, layers)),)
    streamed = layers - min(e.resident_layers, layers)
    g = e.gpu_updated_layers if isinstance(e.gpu_updated_layers, int) else 0  # "auto": none yet
    if g and over("gpu_updated_layers", streamed):
        changes += (("engine.gpu_updated_layers", min(g, streamed)),)
    # the parts updated on the host: the streamed blocks not updated on the GPU, and the io part unless it is
    # resident or updated on the GPU
    n_updated = streamed - min(g, streamed) + (0 if e.resident_io or e.gpu_updated_io is True else 1)
    if over("grads_on_gpu", n_updated):
        changes += (("engine.grads_on_gpu", min(e.grads_on_gpu, n_updated)),)
    if over("disk_parts", layers - min(e.resident_layers, layers)):
        changes += (("engine.disk_parts", min(e.disk_parts, layers - min(e.resident_layers, layers))),)
    if over("offload_activations", layers):
        changes += (("engine.offload_activations", min(e.offload_activations, layers)),)
    # the last blocks that keep their products must not meet the first ones whose inputs are offloaded
    room = layers - offloaded_blocks(layers, e.prefetch_depth, min(e.offload_activations, layers))
    if over("kept_layers", room):
        changes += (("engine.kept_layers", min(e.kept_layers, room)),)
    return changes


def longest_seq_len(p: MemoryPlan, multiple: int = 1024) -> int | None:
    """The longest ``seq_len`` (a multiple of ``multiple``, up to the model's ``max_positions``) at which
    this run, with its rows and engine settings, fits host and GPU; None when nothing does. Where not even
    ``multiple`` tokens fit, or the model's positions stop short of it (a small model), the step is halved
    until one does, and a run that fits at its own length gets at least that length (which need not be a
    multiple). Memory grows with the length, so the fitting lengths are a prefix: bisected."""
    fits = lambda n: p.replace(seq_len=n).fits  # noqa: E731
    while multiple > 1 and (p.model_cfg.max_positions < multiple or not fits(multiple)):
        multiple //= 2
    top = p.model_cfg.max_positions // multiple
    if top < 1 or not fits(multiple):
        return None
    lo, hi = 1, top  # lo * multiple fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * multiple) else (lo, mid - 1)
    return max(lo * multiple, min(p.seq_len, p.model_cfg.max_positions) if p.fits else 0)  # a row past the
    # positions (packed documents) holds no sequence longer than they reach


def machine_needed(p: MemoryPlan, modes: list[InMode] | None = None) -> str:
    """The host RAM and GPU memory on which this run fits as configured, and the host RAM of the leanest
    precision mode where that is another (``modes``: ``in_each_mode(p)`` when already made)."""
    ram, gpu = host_gib_needed(p), math.ceil(p.gpu_total / GiB)
    lean = leanest(in_each_mode(p) if modes is None else modes)
    other = "" if lean.plan is p or lean.host_gib >= ram else (
        f"; in {lean.mode.title}, the leanest precision mode, {lean.host_gib:,d} GiB of host RAM "
        f"({lean.bytes_per_param:.1f} B/param)" + ("" if lean.plan.gpu_fits else
                                                    f" and {math.ceil(lean.plan.gpu_total / GiB)} GiB of GPU"))
    return (f"a machine with at least {ram:,d} GiB of host RAM and a GPU whose allocator may use {gpu} GiB "
            f"({math.ceil(gpu / gpu_fraction())} GiB at {gpu_fraction_var()}={gpu_fraction():g})"
            + other)


def advice(p: MemoryPlan, given: EngineConfig | None = None, modes: list[InMode] | None = None) -> str:
    """What fits instead, as printed by ``check`` and ``megatrain-jax plan`` (``given``: as in ``options``;
    ``modes``: ``in_each_mode(p)`` when already made)."""
    opts = options(p, given)
    same_model = [o for o in opts if not any(key.startswith("model.") for key, _ in o.changes)]
    if same_model:
        text = "options that fit (each re-planned on the same host and GPU):"
    else:
        text = "nothing that keeps this model fits this host and GPU (one change, or two together)."
        text += "\noptions that fit, with a smaller model:" if opts else ""
    lines = [text] + [f"  - {o}" for o in opts] + [f"as configured, it needs {machine_needed(p, modes)}"]
    return "\n".join(lines)


def require_fit(p: MemoryPlan, given: EngineConfig | None = None) -> None:
    """Raise MemoryPlanError with the table and the options that fit, unless the run fits (``given``: as in
    ``options``)."""
    if p.fits:
        return
    where = " and ".join(n for n, ok in (("host RAM", p.host_fits), ("GPU memory", p.gpu_fits),
                                         (f"the disk of engine.disk_dir ({p.engine_cfg.disk_dir})", p.disk_fits))
                         if not ok)
    modes = in_each_mode(p)
    raise MemoryPlanError(f"this run does not fit in {where}.\n{p.table()}\n{modes_table(p, modes)}\n"
                          f"{advice(p, given, modes)}\n"
                          f"(set train.memory_check = false to start anyway)")
