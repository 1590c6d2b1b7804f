"""What ``megatrain-jax plan`` is given, checked before anything is read: sizes in GiB (a figure past any machine is
most likely bytes or MiB written for GiB, and said so), the GPU it names (close names offered), and what this
process's environment makes of the GPUs (hidden ones, a preallocation switch JAX reads otherwise)."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re

from megatrain_jax._environment import MOST_HOST_GIB, not_gib
from megatrain_jax.cli.toml_dataclass import ConfigError

# The most GPU memory ``--gpu-gib`` may give: no card holds a TiB. A larger figure is nvidia-smi's MiB (81559 for an
# H100) or bytes written for GiB.
MOST_GPU_GIB = 1024


def gib(text: str, most: float = MOST_HOST_GIB) -> float:
    """An argparse type: a size in GiB, a positive finite number (``inf``, ``nan``, ``0`` and ``-3`` are
    refused by argparse with this message, as bad input) of at most ``most`` (past it: no machine, most likely
    bytes or MiB written for GiB, said so)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GiB: give a positive, finite number (e.g. 80)")
    if value > most:
        raise argparse.ArgumentTypeError(f"{text!r} is more than any machine has (at most {most:,} GiB): give "
                                         f"GiB{not_gib(value, most)}")
    return value


def gpu_gib(text: str) -> float:
    """``gib`` for the GPU: at most ``MOST_GPU_GIB``."""
    return gib(text, MOST_GPU_GIB)


def gpu_kind(name: str | None, speeds: str | None) -> str | None:
    """The record (``speeds.SPEEDS``' key) of the GPU ``plan --gpu NAME`` names: its name as the driver gives it
    (``NVIDIA H100 80GB HBM3``) or as the records do (``h200``, ``RTX 4090``), the record's name a whole word in it;
    None for no name, or for a GPU without a record where ``--speeds FILE`` gives its rates. Any other name is
    refused, with the record it is closest to (``H2000``: H200; ``rtx4090``: RTX 4090), before anything is read."""
    from megatrain_jax.plan.speeds import SPEEDS, kind_of
    kind = kind_of(name)
    if name is None or (kind is not None and re.search(rf"(?<![A-Z0-9]){re.escape(kind)}(?![A-Z0-9])", name.upper())):
        return kind
    if speeds is not None:
        return None
    squeezed = {_squeeze(k): k for k in SPEEDS}  # "RTX4090": "RTX 4090"
    close = [k for s, k in squeezed.items() if _squeeze(name) and _squeeze(name) in s]
    close = close or [squeezed[s] for s in difflib.get_close_matches(_squeeze(name), squeezed, n=1, cutoff=0.8)]
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"--gpu {name!r}: no rates for that GPU; {hint}give one of {', '.join(SPEEDS)}, or --speeds "
                      f"FILE with its rates")


def _squeeze(name: str) -> str:
    """A GPU's name in capitals without spaces or punctuation, as close names are compared."""
    return re.sub(r"[^A-Z0-9]", "", name.upper())


def environment_notes(no_gpu_given: bool) -> list[str]:
    """What the plan should say about this process's environment: GPUs that ``CUDA_VISIBLE_DEVICES`` hides (where no
    GPU is given to plan for, the plan then has no GPU side), and a preallocation switch JAX reads otherwise."""
    from megatrain_jax._environment import gpus_hidden, preallocation_note
    notes = []
    if no_gpu_given and gpus_hidden():
        notes.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU from this process: "
                     f"the plan has no GPU side, and train would run on the CPU. Name the GPUs to use (e.g. "
                     f"CUDA_VISIBLE_DEVICES=0) or unset it; --gpu NAME or --gpu-gib N plans for a GPU")
    return notes + [note for note in [preallocation_note()] if note is not None]
