"""What fits instead: for a run whose plan does not fit, the changes to its config that do (each
re-planned), the words that explain them, and the engine config ``megatrain-jax train`` runs
(``lean_engine``).

The levers are listed fastest first (``_levers``): GPU-resident blocks, resident io, the stream dtype, the
disk tier, gradients waiting on the GPU, capacity mode, capacity mode with 8-bit moments and bfloat16
gradients, kept attention residuals, activation offload,
micro-batches, prefetch depth, fewer rows with more accumulation, shorter sequences, and last a smaller
model. Each search re-plans with ``MemoryPlan.applied``; where memory is monotone in a lever's value, the
search bisects.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator

from megatrain_jax.engine.config import AUTO, EngineConfig
from megatrain_jax.engine.schedule import offloaded_blocks
from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.engine.parts import part_ids
from megatrain_jax.plan.counts import GiB, activation_bytes, host_roles, layer_param_count, q8_moment_bytes
from megatrain_jax.plan.activations import assumes_flash, kept_bytes
from megatrain_jax.plan.machine import (HOST_POOL_FRACTION, available_disk_bytes, available_host_bytes,
                                        gpu_bytes_before_jax, gpu_fraction)
from megatrain_jax.plan.memory import MemoryPlan, MemoryPlanError, plan

# What the lean full-precision pick leaves free of the host's available memory where it can. The plan's host
# total has come out 0-4% under the peaks measured at step ends (tests/assets/measured/h100_plan_check.json), and
# the process cannot have all of MemAvailable: the shipped h200_sft_8b config, lean-picked with 3% on a 125.9 GiB
# H200 host (plan 120.0 GiB), was killed by the kernel's OOM killer at its final save with 122.5 GiB resident and
# growing (experiments/results/h200_shipped_configs_s10_h200_sft_8b_c.json and its .mem.log): ~4% over the plan,
# and ~2.3% of the host out of reach. So 7%.
LEAN_HOST_MARGIN = 0.07


# ---------------------------------------------------------------------------------------------- options
@dataclasses.dataclass(frozen=True)
class Option:
    """A change to the run's config that was re-planned and fits: ``changes`` as (``section.key``, value)
    pairs, ``why`` says what it changes and what it costs in speed."""

    changes: tuple[tuple[str, Any], ...]
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



def _levers(p: MemoryPlan) -> Iterator[tuple[str, list[tuple[tuple[str, Any], ...]], Callable]]:
    """Each lever: its name, candidate changes fastest first, and the words for a chosen change."""
    e, c, rows, seq = p.engine_cfg, p.model_cfg, p.batch_rows, p.seq_len
    n_updated = lambda r, io: c.layers - r + (0 if io else 1)  # noqa: E731  (host-updated parts)
    if e.kept_layers:  # first: it costs only the recompute it saved
        yield ("kept", [(("engine.kept_layers", k),) for k in range(e.kept_layers - 1, -1, -1)],
               lambda ch: (f"the last {ch[0][1]} blocks keep their matrix products for the backward instead of "
                           f"{e.kept_layers} (the others recompute them: slower)"))
    resident = [(("engine.resident_layers", r),) for r in range(c.layers, -1, -1)
                if r != e.resident_layers and n_updated(r, e.resident_io) >= e.grads_on_gpu and not e.capacity
                and c.layers - r >= e.disk_parts]
    yield ("resident", resident,
           lambda ch: (f"{ch[0][1]} GPU-resident blocks instead of {e.resident_layers}: " +
                       ("fewer blocks update on the GPU, so the next forward may wait on the host optimizer "
                        "(slower)" if ch[0][1] < e.resident_layers else
                        "their gradients stay on the GPU (4 B/param less host RAM) and they update there "
                        "(faster)")))
    io = [(("engine.resident_io", not e.resident_io),)]
    ok = n_updated(e.resident_layers, not e.resident_io) >= e.grads_on_gpu and not e.capacity
    yield ("resident_io", io if ok else [],
           lambda ch: "io part (embedding, head) " + ("kept on the GPU (faster)" if ch[0][1] else
                                                      "streamed instead of GPU-resident (slower first block)"))
    other = "float32" if p.stream_dtype in ("bfloat16", "float16") else "bfloat16"
    yield ("stream", [] if e.capacity else [(("engine.stream_dtype", other),)],
           lambda ch: ("stream the float32 masters: no 16-bit host copy (2 B/param less host RAM), twice the "
                       "bytes per layer over PCIe (hidden behind compute from about 16K tokens per layer visit "
                       "on an H100)") if other == "float32" else
           ("stream bfloat16 weights: half the PCIe bytes (faster); the host keeps a 16-bit copy (+2 B/param)"))
    if e.disk_dir and e.host_kernel and not e.q8:  # the tier runs with the fused kernel only, not 8-bit moments
        blocks = c.layers - e.resident_layers
        gib = lambda n: n * layer_param_count(c) * (4 if e.capacity else 8) / GiB  # noqa: E731
        yield ("disk", [(("engine.disk_parts", n),) for n in range(1, blocks + 1) if n != e.disk_parts],
               lambda ch: (f"the Adam moments of the last {ch[0][1]} blocks in files under {e.disk_dir} "
                           f"({gib(ch[0][1]):.1f} GiB, read and written once per step: slower unless the disk "
                           f"keeps up with the host optimizer)"))
    n_host = len(host_roles(c, e).host_updated)
    yield ("grads_on_gpu", [(("engine.grads_on_gpu", n),) for n in range(1, n_host + 1) if n != e.grads_on_gpu],
           lambda ch: (f"the float32 gradients of {ch[0][1]} parts wait on the GPU for the global norm instead of "
                       f"in host memory (4 B/param less host RAM for them, as much more GPU memory); each "
                       f"comes home when its update runs"))
    to = {"engine.master_dtype": "bfloat16", "engine.stream_dtype": "bfloat16", "engine.resident_layers": 0,
          "engine.resident_io": False}
    now = {"engine.master_dtype": e.master_dtype, "engine.stream_dtype": p.stream_dtype,
           "engine.resident_layers": e.resident_layers, "engine.resident_io": e.resident_io,
           "engine.disk_parts": e.disk_parts}
    switch = lambda changes: tuple((k, v) for k, v in changes.items() if now.get(k) != v)  # noqa: E731
    on_host = "; every part updates on the host" if e.resident_layers or e.resident_io else ""
    if not e.capacity and e.host_kernel:  # capacity mode runs in the fused kernel
        yield ("capacity", [switch(to)],
               lambda ch: ("capacity mode: bfloat16 masters and Adam moments, stochastically rounded (6 B/param "
                           "instead of 12, no 16-bit copy; quality: docs/capacity.md)" + on_host))
    if not e.q8 and e.host_kernel:  # below capacity mode's precision: its moments in 8 bits, all in memory
        q8 = switch({**to, "engine.moment_dtype": "q8", "engine.host_grad_dtype": "bfloat16", "engine.disk_parts": 0})
        # the moments' bytes are counted leaf by leaf only when the words are asked for (the searches call
        # _levers again for every candidate they try)
        moments = lambda: sum(q8_moment_bytes(c, part) for part in part_ids(c.layers)) / c.param_count()  # noqa: E731
        yield ("q8", [q8],
               lambda ch: (f"capacity mode with 8-bit Adam moments and bfloat16 gradients in host memory (about "
                           f"{2 + moments():.1f} B/param of masters and moments + 2 B/param of gradients; "
                           f"stochastically rounded, quality: docs/capacity.md)" + on_host +
                           ("; no disk tier" if e.disk_parts else "")))
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
    yield ("rows", fewer,
           lambda ch: (f"{ch[0][1]} rows per pass, {ch[1][1]} passes per optimizer step (the same tokens per "
                       f"step): fewer boundary activations; the weights cross PCIe twice per pass, "
                       f"{ch[1][1] // e.accumulate_steps}x the transfers per step"))
    shorter = [(("data.seq_len", seq // k),) for k in (2, 4, 8, 16) if seq % k == 0 and seq // k >= 128]
    yield ("seq", shorter, lambda ch: f"sequences of {ch[0][1]} tokens: shorter context (changes what the model "
                                      f"learns) and fewer tokens per step")


def _first_fit(p: MemoryPlan, candidates: list) -> tuple[tuple[str, Any], ...] | None:
    """The first candidate that fits. More resident blocks need more GPU and less host memory, so that
    lever is bisected for the most blocks that fit the GPU; more gradients on the GPU need less host
    memory, so that one for the fewest that fit the host; the others have few candidates."""
    if candidates and candidates[0][0][0] in ("engine.grads_on_gpu", "engine.disk_parts"):
        return _fewest(p, candidates[0][0][0], sorted(ch[0][1] for ch in candidates))
    if candidates and candidates[0][0][0] == "engine.offload_activations":
        return _fewest(p, candidates[0][0][0], sorted(ch[0][1] for ch in candidates), gpu=True)
    if candidates and candidates[0][0][0] == "engine.resident_layers":
        values = sorted(ch[0][1] for ch in candidates)
        lo, hi = 0, len(values)
        while lo < hi:  # lo: how many values fit the GPU
            mid = (lo + hi) // 2
            ok = p.applied((("engine.resident_layers", values[mid]),)).gpu_fits
            lo, hi = (mid + 1, hi) if ok else (lo, mid)
        best = (("engine.resident_layers", values[lo - 1]),) if lo else None
        return best if best is not None and p.applied(best).fits else None
    return next((ch for ch in candidates if _fits(p, ch)), None)


def _fits(p: MemoryPlan, changes: tuple[tuple[str, Any], ...]) -> bool:
    """Whether the plan with ``changes`` fits; a combination the engine refuses does not."""
    try:
        return p.applied(changes).fits
    except ValueError:
        return False


def _fewest(p: MemoryPlan, key: str, values: list[int], gpu: bool = False) -> tuple[tuple[str, Any], ...] | None:
    """The smallest of ``values`` for ``key`` whose plan fits the host (more of it, less host memory), or
    with ``gpu`` the GPU (more of it, less GPU memory), if that plan fits everything."""
    best = _first_fitting(p, key, values, gpu)
    return best if best is not None and p.applied(best).fits else None


def _first_fitting(p: MemoryPlan, key: str, values: list[int], gpu: bool) -> tuple[tuple[str, Any], ...] | None:
    """The smallest of ``values`` for ``key`` whose plan fits the host (with ``gpu``: the GPU), bisected:
    more of it takes less of that memory."""
    lo, hi = 0, len(values)
    while lo < hi:  # lo: the first value whose plan fits
        mid = (lo + hi) // 2
        q = p.applied(((key, values[mid]),))
        lo, hi = (lo, mid) if (q.gpu_fits if gpu else q.host_fits) else (mid + 1, hi)
    return ((key, values[lo]),) if lo < len(values) else None


def lean(p: MemoryPlan) -> tuple[tuple[str, Any], ...] | None:
    """Full precision in less host RAM, for a run that does not fit the host: the float32 masters are
    streamed (no 16-bit host copy), and if that is not enough, the fewest parts' gradients wait on the
    GPU; with ``LEAN_HOST_MARGIN`` of the host left over where possible. In capacity mode, where that does
    not fit even without the margin: 8-bit moments and bfloat16 gradients (``_leanest_q8``), so that the
    lower precision is picked only where capacity mode's own does not fit. Then (with a ``disk_dir``) the
    fewest blocks' moments in the disk tier: last, because it reads and writes their moments every step
    (at 70B, hundreds of GB per step through the disk), where 8-bit moments cost no time. The changes, or
    None where the run fits already or even this does not fit."""
    if p.host_fits:
        return None
    plans = [p] if p.host_available is None else [
        p.replace(host_ram_bytes=int(p.host_available * (1 - LEAN_HOST_MARGIN))), p]
    for leanest in (lambda q: _leanest(q, disk=False), _leanest_q8, _leanest):
        for q in plans:
            changes = leanest(q)
            if changes is not None:
                return changes
    return None


def offload(p: MemoryPlan) -> tuple[tuple[str, Any], ...] | None:
    """For a run that does not fit the GPU: the fewest blocks whose inputs wait in host memory
    (``engine.offload_activations``) that make the GPU fit, whether or not the host then fits (more
    host RAM: ``lean_engine`` then makes the host lean where it can); None where the GPU fits already or
    no count makes it fit."""
    if p.gpu_fits or p.gpu_available is None:
        return None
    return _first_fitting(p, "engine.offload_activations", offload_counts(p), gpu=True)


def offload_counts(p: MemoryPlan) -> list[int]:
    """The ``engine.offload_activations`` values above this run's that offload more blocks."""
    e, layers = p.engine_cfg, p.model_cfg.layers
    most = min(offloaded_blocks(layers, e.prefetch_depth, layers), layers - e.kept_layers)  # not the kept blocks
    return list(range(e.offload_activations + 1, most + 1))


def _leanest(p: MemoryPlan, disk: bool = True) -> tuple[tuple[str, Any], ...] | None:
    stream = () if p.stream_dtype == "float32" or p.engine_cfg.capacity else (
        ("engine.stream_dtype", "float32"),)
    streamed = p.applied(stream)
    if streamed.host_fits:
        return stream if streamed.fits else None
    n_host = len(host_roles(p.model_cfg, p.engine_cfg).host_updated)
    grads = _fewest(streamed, "engine.grads_on_gpu", list(range(1, n_host + 1)))
    if grads is not None:
        return stream + grads
    e = p.engine_cfg
    if disk and e.disk_dir and not e.disk_parts and e.host_kernel and not e.q8:  # the last blocks' moments on disk
        blocks = p.model_cfg.layers - p.engine_cfg.resident_layers
        disk = _fewest(streamed, "engine.disk_parts", list(range(1, blocks + 1)))
        return None if disk is None else stream + disk
    return None


def _leanest_q8(p: MemoryPlan) -> tuple[tuple[str, Any], ...] | None:
    """Capacity mode with 8-bit moments and bfloat16 gradients in host memory, and if that is not enough
    the fewest parts' gradients on the GPU (``_leanest``); None outside capacity mode (opt-in), where the
    moments are 8-bit already, or where even this does not fit."""
    e = p.engine_cfg
    if not e.capacity or e.q8:
        return None
    q8 = (("engine.moment_dtype", "q8"), ("engine.host_grad_dtype", "bfloat16"))
    changes = _leanest(p.applied(q8))
    return None if changes is None else q8 + changes


def options(p: MemoryPlan, given: EngineConfig | None = None) -> list[Option]:
    """Changes that make the run fit in both host and GPU memory, each re-planned: one lever at a time,
    and where none of those keeps full precision (capacity mode may fit alone), pairs of the other
    levers; a smaller model last. Empty when nothing of that kind fits.

    ``given`` is the engine as the config file sets it, where ``p`` plans the one ``train`` picked from it
    (``lean_engine``): the options are overrides of that file, so a smaller model also clips the file's
    per-block counts that the smaller model could not hold."""
    if p.fits:
        return []
    levers = sorted(_levers(p), key=lambda lever: lever[0] == "resident")  # resident last: bisected
    out = []
    for name, candidates, words in levers:
        ch = _first_fit(p, candidates)
        if ch is not None:
            out.append((name, Option(ch, words(ch))))
    if all(name in ("capacity", "q8") for name, _ in out):  # nothing at full precision yet: pairs of levers
        levers = [lever for lever in levers if lever[0] not in ("capacity", "q8")]
        for i, (_, first, words1) in enumerate(levers):
            for name2, _, _ in levers[i + 1:]:
                for ch1 in first[:6]:
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


def _smaller(p: MemoryPlan, layers: int, given: EngineConfig | None = None) -> tuple[tuple[str, Any], ...]:
    """A model of ``layers`` layers, and each per-block count of the planned engine clipped to what it can
    hold; a count that only the config file (``given``) sets past ``layers`` is written as planned, so that
    the overrides pass the file's checks and re-plan as this option was planned."""
    changes: tuple[tuple[str, Any], ...] = (("model.layers", layers),)
    e = p.engine_cfg
    over = lambda name, limit: (getattr(e, name) > limit  # noqa: E731
                                or (given is not None and isinstance(getattr(given, name), int)
                                    and getattr(given, name) > limit))
    if over("resident_layers", layers):
        changes += (("engine.resident_layers", min(e.resident_layers, layers)),)
    n_updated = layers - min(e.resident_layers, layers) + (0 if e.resident_io else 1)
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
    this run, with its rows and engine settings, fits host and GPU; None when not even ``multiple``
    does. Memory grows with the length, so the fitting lengths are a prefix: bisected."""
    top = p.model_cfg.max_positions // multiple
    fits = lambda k: p.replace(seq_len=k * multiple).fits  # noqa: E731
    if top < 1 or not fits(1):
        return None
    lo, hi = 1, top  # fits(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * multiple


def machine_needed(p: MemoryPlan) -> str:
    """The host RAM and GPU memory on which this run fits as configured."""
    ram = math.ceil(max(p.host_pinned / HOST_POOL_FRACTION, p.host_total) / GiB)
    while not p.replace(host_ram_bytes=ram * GiB, host_pool_limit=None, gpu_bytes=None).host_fits:
        ram += 1
    gpu = math.ceil(p.gpu_total / GiB)
    return (f"a machine with at least {ram} GiB of host RAM and a GPU whose allocator may use {gpu} GiB "
            f"({math.ceil(gpu / gpu_fraction())} GiB at XLA_PYTHON_CLIENT_MEM_FRACTION={gpu_fraction():g})")


def advice(p: MemoryPlan, given: EngineConfig | None = None) -> str:
    """What fits instead, as printed by ``check`` and ``megatrain-jax plan`` (``given``: as in ``options``)."""
    opts = options(p, given)
    same_model = [o for o in opts if not any(key.startswith("model.") for key, _ in o.changes)]
    if same_model:
        text = "options that fit (each re-planned on the same host and GPU):"
    else:
        text = "nothing that keeps this model fits this host and GPU (one change, or two together)."
        text += "\noptions that fit, with a smaller model:" if opts else ""
    lines = [text] + [f"  - {o}" for o in opts] + [f"as configured, it needs {machine_needed(p)}"]
    return "\n".join(lines)


def require_fit(p: MemoryPlan, given: EngineConfig | None = None) -> None:
    """Raise MemoryPlanError with the table and the options that fit, unless the run fits (``given``: as in
    ``options``)."""
    if p.fits:
        return
    where = " and ".join(n for n, ok in (("host RAM", p.host_fits), ("GPU memory", p.gpu_fits)) if not ok)
    raise MemoryPlanError(f"this run does not fit in {where}.\n{p.table()}\n{advice(p, given)}\n"
                          f"(set train.memory_check = false to start anyway)")


def lean_engine(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                host_ram_bytes: int | None = None, disk_dir: str | None = None, gpu_bytes: int | None = None,
                **plan_kw) -> tuple[EngineConfig, str | None]:
    """The engine config ``megatrain-jax train`` runs: as given, unless memory is short.

    - Host RAM (default: this machine's MemAvailable) short, and the config leaves the stream dtype unset
      and no gradients on the GPU: the lean full-precision mode that fits (``lean``; in capacity
      mode, gradients waiting on the GPU alone, and where even that does not fit, 8-bit moments and
      bfloat16 gradients in host memory). ``disk_dir`` (where the config sets none) is where the
      disk tier may go when nothing else fits.
    - The GPU short, and no activation offload configured: the fewest blocks whose inputs wait in host
      memory that make the run fit (``offload``).
    - Nothing of that fits while each block keeps its attention residuals (``keep_residuals``): the same
      search without them, if that fits.

    Returns the config and a sentence saying what was picked (None: as given). ``gpu_bytes`` defaults to
    ``gpu_bytes_before_jax()``. Reads nothing from JAX, so it can run before JAX starts its GPU backend."""
    host_ram_bytes = available_host_bytes() if host_ram_bytes is None else host_ram_bytes
    gpu_bytes = gpu_bytes_before_jax() if gpu_bytes is None else gpu_bytes
    kw = dict(host_ram_bytes=host_ram_bytes, gpu_bytes=gpu_bytes, **plan_kw)
    engine_cfg, fewer_kept = most_kept(model_cfg, engine_cfg, batch_rows, seq_len, **kw)
    engine_cfg, auto = most_resident(model_cfg, engine_cfg, batch_rows, seq_len, **kw)
    picked, said = _fit_engine(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw)
    said = [w for w in (fewer_kept, auto) if w] + said
    flash = assumes_flash(model_cfg)
    keeps = engine_cfg.keep_residuals and kept_bytes(model_cfg, engine_cfg, 1, 1, flash) > 0
    if keeps and not plan(model_cfg, picked, batch_rows, seq_len, detect=False, **kw).fits:
        # the kept attention residuals are one more activation per block: without them attention is
        # recomputed in the backward (slower), and the blocks' inputs may fit where both do not
        recompute = dataclasses.replace(engine_cfg, keep_residuals=False)
        plain, plain_said = _fit_engine(model_cfg, recompute, batch_rows, seq_len, disk_dir, kw)
        if plan(model_cfg, plain, batch_rows, seq_len, detect=False, **kw).fits:
            return plain, "; ".join(["keeping attention's output for the backward does not fit: attention is "
                                     "recomputed in the backward (engine.keep_residuals=false)"] + plain_said)
    return picked, ("; ".join(said) or None)


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
    fits = lambda k: plan(model_cfg, with_(k), batch_rows, seq_len, detect=False, **plan_kw).gpu_fits  # noqa: E731
    if fits(engine_cfg.kept_layers):
        return engine_cfg, None
    lo = _most_fitting(fits, engine_cfg.kept_layers - 1)  # none, where not even 0 fits: nothing else to give up
    p = plan(model_cfg, with_(lo), batch_rows, seq_len, detect=False, **plan_kw)
    return dataclasses.replace(engine_cfg, kept_layers=lo), (
        f"GPU memory is short for engine.kept_layers={engine_cfg.kept_layers}: the last {lo} blocks keep their "
        f"matrix products for the backward (engine.kept_layers={lo}; GPU {p.gpu_total / GiB:.1f} GiB of "
        f"{p.gpu_available / GiB:.1f})")


def _most_fitting(fits: Callable[[int], bool], hi: int) -> int:
    """The largest ``n`` in 0..``hi`` with ``fits(n)``, bisected (GPU memory grows with ``n``); 0 where none
    above 0 fits."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def most_resident(model_cfg: DecoderConfig, engine_cfg: EngineConfig, batch_rows: int, seq_len: int,
                  **plan_kw) -> tuple[EngineConfig, str | None]:
    """``resident_layers="auto"`` made a number: the most blocks kept on the GPU (with their optimizer
    state, updated there: no host update and no transfer for them) that the plan fits in GPU memory with its
    margin, the io part as configured, leaving the blocks that ``grads_on_gpu`` and ``disk_parts`` name. 0
    where nothing can be resident: capacity mode (every part updates on the host), no GPU to plan for, or
    the GPU full without any. Returns the config and a sentence (None: the config did not ask)."""
    if engine_cfg.resident_layers != AUTO:
        return engine_cfg, None
    with_ = lambda r: dataclasses.replace(engine_cfg, resident_layers=r)  # noqa: E731
    if engine_cfg.capacity:
        return with_(0), "engine.resident_layers='auto': 0 (capacity mode updates every part on the host)"
    if plan_kw.get("gpu_bytes") is None:
        return with_(0), "engine.resident_layers='auto': 0 (no GPU to plan for)"
    fits = lambda r: plan(model_cfg, with_(r), batch_rows, seq_len, detect=False, **plan_kw).gpu_fits  # noqa: E731
    e, n = engine_cfg, model_cfg.layers  # the host-updated parts those options name must stay so
    hi = max(min(n, n + (0 if e.resident_io else 1) - e.grads_on_gpu, n - e.disk_parts), 0)
    if not fits(0):
        return with_(0), "engine.resident_layers='auto': 0 (the GPU is full without any)"
    lo = _most_fitting(fits, hi)
    p = plan(model_cfg, with_(lo), batch_rows, seq_len, detect=False, **plan_kw)
    return with_(lo), (f"engine.resident_layers='auto': {lo} of {model_cfg.layers} blocks GPU-resident, the most "
                       f"that fit (GPU {p.gpu_total / GiB:.1f} GiB of {p.gpu_available / GiB:.1f}; they update on the "
                       f"GPU, with no host update or transfer)")


def _fit_engine(model_cfg, engine_cfg, batch_rows, seq_len, disk_dir, kw) -> tuple[EngineConfig, list[str]]:
    """``lean_engine`` for one setting of ``keep_residuals``: the config, and what was picked in words."""
    user_host = engine_cfg.stream_dtype is not None or engine_cfg.grads_on_gpu or engine_cfg.disk_parts
    said = []
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


def _lean_host(model_cfg, engine_cfg, batch_rows, seq_len, *, host_ram_bytes, gpu_bytes, disk_dir=None,
               **plan_kw) -> tuple[EngineConfig, str | None]:
    """``lean_engine``'s host part: the lean layout that fits the host (``lean``), and the words."""
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
    said = " ".join(f"{k}={v}" for k, v in changes)
    if leaner.engine_cfg.q8 and not engine_cfg.q8:
        said = f"8-bit Adam moments and bfloat16 gradients in host memory ({said}; quality: docs/capacity.md)"
    if leaner.engine_cfg.disk_parts:
        said += (f" (engine.disk_dir={leaner.engine_cfg.disk_dir}: {leaner.disk / GiB:.1f} GiB of Adam moments in "
                 f"files, read and written once per step)")
    return leaner.engine_cfg, (f"host RAM is short ({p.host_total / GiB:.1f} GiB needed, "
                               f"{p.host_available / GiB:.1f} available): running "
                               f"{'capacity mode with' if engine_cfg.capacity else 'in the lean full-precision mode'} "
                               f"{said}, {leaner.host_total / leaner.params:.1f} host bytes per parameter instead of "
                               f"{p.host_total / p.params:.1f} ({leaner.host_total / GiB:.1f} GiB)")

