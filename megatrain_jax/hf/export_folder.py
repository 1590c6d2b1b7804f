"""Exports that never clobber and never leave a half-written model (issue 32).

A Hugging Face export is written whole into a sibling folder (``.NAME.partial-PID``) and then put in place
in one step. Where the target folder already exists, ``renameat2(RENAME_EXCHANGE)`` swaps the two folders
atomically (Linux 3.15+, on ext4, xfs, btrfs, tmpfs and most local file systems), so a kill at any moment
leaves the target holding either the old model or the new one, whole. The swapped-out folder's entries
that are not part of a model (the user's own files, other folders) are then moved into the new one, and the
rest removed. Where the file system cannot exchange, the old folder is renamed aside first
(``.NAME.old-PID``) and the new one renamed in: a kill between those two renames leaves both whole, the
target path empty for that moment.

A folder that already holds a model is refused unless the caller asks to overwrite, and the model's files
(weights, index, ``config.json``, the tokenizer files) always come from the new export, never from the
folder's past. A folder that holds no model (say, only a tokenizer) keeps every file the export does not
replace.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import warnings
from pathlib import Path

from megatrain_jax.hf.safetensors_io import stale_files

# What a model folder holds besides its weights: transformers reads these next to them.
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   GENERATION_CONFIG)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class ExportExistsError(FileExistsError):
    """The export's target folder already holds a model."""


def tokenizer_files(source: str | os.PathLike | None, given: bool = False) -> list[Path]:
    """The tokenizer and generation files of ``source`` (a model or tokenizer folder), to go next to exported
    weights: transformers then loads model, tokenizer and generation settings from one folder. ``given``: the user
    named ``source`` as the tokenizer to export with, so a path that is missing, a file, or a folder with none of
    these files is an error rather than an export without them, and a folder without ``tokenizer.json`` (its
    generation settings only, say) is warned about."""
    if source is None:
        return []
    source = Path(source)
    if given and not source.is_dir():
        raise (FileNotFoundError if not source.exists() else ValueError)(
            f"tokenizer {source} {'does not exist' if not source.exists() else 'is a file'}: give the folder that "
            f"holds tokenizer.json (the Hugging Face model the weights came from, say)")
    found = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if given and not found:
        raise ValueError(f"tokenizer folder {source} holds none of {', '.join(TOKENIZER_FILES)} (it holds "
                         f"{sorted(p.name for p in source.iterdir())[:8]}): give the folder that holds tokenizer.json")
    if given and not (source / "tokenizer.json").is_file():
        warnings.warn(f"tokenizer folder {source} has no tokenizer.json: the export gets its "
                      f"{', '.join(p.name for p in found)} only, and transformers loads no tokenizer from it",
                      stacklevel=3)
    return found


def model_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that belong to a model: weights, their index, ``config.json`` and the
    tokenizer files."""
    if not folder.is_dir():
        return []
    named = [folder / n for n in ("config.json", *TOKENIZER_FILES) if (folder / n).exists()]
    return sorted(set(named) | set(stale_files(folder)))


def holds_model(folder: Path) -> bool:
    """Whether ``folder`` holds a model: ``config.json`` or weights (a tokenizer alone is not one)."""
    return (folder / "config.json").exists() or any(stale_files(folder))


def check_target(folder: str | os.PathLike, overwrite: bool, how: str) -> None:
    """Refuse a ``folder`` that holds a model (weights or ``config.json``) unless ``overwrite``; ``how`` says
    how the caller asks to overwrite."""
    folder = Path(folder)
    if not overwrite and holds_model(folder):
        raise ExportExistsError(f"{folder} already holds a model ({', '.join(p.name for p in model_files(folder))}); "
                                f"nothing was written. To replace it, {how}; or export to another folder")
    if folder.exists() and not folder.is_dir():
        raise ExportExistsError(f"{folder} is a file, not a folder: export to a folder")


def staging(folder: str | os.PathLike) -> Path:
    """An empty sibling folder of ``folder`` to write the export into (of the folder a symlink ``folder`` leads
    to: that folder is the one replaced, and the link stays as it is)."""
    folder = Path(folder).resolve()
    staged = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged


def publish(staged: Path, folder: str | os.PathLike) -> None:
    """Put the finished export ``staged`` at ``folder`` in one step (see the module docstring): at the folder a
    symlink ``folder`` leads to, as ``staging`` put ``staged`` beside it."""
    folder = Path(folder).resolve()
    if not folder.exists():
        os.rename(staged, folder)
        return
    if _exchange(staged, folder):
        old = staged  # the swapped-out folder is now at the staging path
    else:
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(folder, old)
        try:
            os.rename(staged, folder)
        except OSError:
            os.rename(old, folder)  # the old model back where it was
            raise
    # A model's files come from the new export, never from the folder's past; but a folder that held no model
    # (no config.json, no weights: e.g. only a tokenizer) held only the user's own files, and all of them stay.
    keep = set(model_files(old)) if holds_model(old) else set()
    keep -= set(_tokenizer_kept(old, folder))
    for entry in old.iterdir():  # the user's own files go on living in the folder
        if entry not in keep and not (folder / entry.name).exists():
            os.rename(entry, folder / entry.name)
    shutil.rmtree(old, ignore_errors=True)


def _tokenizer_kept(old: Path, new: Path) -> list[Path]:
    """The replaced model's tokenizer files that stay beside an export that brings no tokenizer: where both models
    have one vocabulary size (the same model written again, say in another dtype), with a warning naming them; where
    the sizes differ, none (the tokenizer was the other model's), with a warning naming what goes."""
    if (new / "tokenizer.json").exists():
        return []
    tokenizer = [p for p in tokenizer_files(old) if p.name != GENERATION_CONFIG]
    if not tokenizer:
        return []
    names = ", ".join(p.name for p in tokenizer)
    if _vocab_size(old) is not None and _vocab_size(old) == _vocab_size(new):
        warnings.warn(f"{new}: the export brings no tokenizer; kept the one the folder held ({names}), of a model "
                      f"with the same vocabulary size. Export with a tokenizer (tokenizer=, --tokenizer) to replace it",
                      stacklevel=3)
        return tokenizer
    warnings.warn(f"{new}: removed the tokenizer of the model it held ({names}): the export brings none and its "
                  f"vocabulary size differs. Export with a tokenizer (tokenizer=, --tokenizer) for a folder "
                  f"transformers loads whole", stacklevel=3)
    return []


def _vocab_size(folder: Path) -> int | None:
    try:
        return json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    ok = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0
    return ok
