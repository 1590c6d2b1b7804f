"""Exports that never clobber and never leave a half-written model (issue 32).

A Hugging Face export is written whole into a staging folder (``.NAME.partial-PID-XXXX``) and then put in place.
Where the target folder does not exist yet, the staging folder beside it is renamed to it in one step. Where it
holds a model, ``renameat2(RENAME_EXCHANGE)`` swaps the two folders atomically (Linux 3.15+, on ext4, xfs, btrfs,
tmpfs and most local file systems), so a kill at any moment leaves the target holding either the old model or the
new one, whole; the swapped-out folder's entries that are not part of a model (the user's own files, other
folders) are then moved into the new one, and the rest removed. Where the file system cannot exchange, the old
folder is renamed aside first (``.NAME.partial-old-PID-XXXX``) and the new one renamed in: a kill between those two renames
leaves both whole, the target path empty for that moment. An entry that cannot be moved back is never removed: it
stays in the swapped-out folder, which the error names.

A folder that holds no model (a tokenizer, the user's notes, other models' folders, a mount point) is never swapped:
the export is staged inside it and its files moved in one by one, ``config.json`` last, so the folder is never
without its own entries, and a kill leaves no folder that looks like a whole model.

A folder that already holds a model is refused unless the caller asks to overwrite, and the model's files
(weights, index, ``config.json``, the tokenizer files) always come from the new export, never from the folder's
past. A folder that holds no model keeps every file the export does not replace.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import secrets
import shutil
import warnings
from pathlib import Path

from megatrain_jax.hf.safetensors_io import INDEX_FILE, stale_files

# What a model folder holds besides its weights: transformers reads these next to them. A tokenizer's vocabulary is
# in one of VOCAB_FILES (tokenizer.json for the fast tokenizers; sentencepiece's tokenizer.model for Llama 2, Mistral,
# Gemma and Phi-3, which llama.cpp's converter needs; the BPE vocab.json and merges.txt of Qwen; tiktoken's file).
GENERATION_CONFIG = "generation_config.json"
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
TOKENIZER_FILES = (*VOCAB_FILES, "merges.txt", "added_tokens.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", GENERATION_CONFIG)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class ExportExistsError(FileExistsError):
    """The export's target folder already holds a model."""


def tokenizer_files(source: str | os.PathLike | None, given: bool = False) -> list[Path]:
    """The tokenizer and generation files of ``source`` (a model or tokenizer folder), to go next to exported
    weights: transformers then loads model, tokenizer and generation settings from one folder. ``given``: the user
    named ``source`` as the tokenizer to export with, so a path that is missing, a file, or a folder with none of
    these files is an error rather than an export without them, and a folder with no vocabulary (its generation
    settings only, say) is warned about."""
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
    if given and not any(p.name in VOCAB_FILES for p in found):
        warnings.warn(f"tokenizer folder {source} has no tokenizer.json: the export gets its "
                      f"{', '.join(p.name for p in found)} only, and transformers loads no tokenizer from it (there is "
                      f"no {', '.join(VOCAB_FILES[1:])} either)", stacklevel=3)
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


def check_target(folder: str | os.PathLike, overwrite: bool, how: str, *,
                 source: str | os.PathLike | None = None) -> None:
    """Refuse a ``folder`` that holds a model (weights or ``config.json``) unless ``overwrite``; ``how`` says
    how the caller asks to overwrite. Also refused, overwrite or not: a file, a path through a file, the folder
    ``source`` that the exported weights were loaded from (a run's ``model.hf_checkpoint``: the export would
    replace the model it started from), and a mount point that holds a model (it cannot be swapped for the new
    export in one step)."""
    folder = Path(folder)
    if source is not None and folder.resolve() == Path(source).resolve():
        raise ExportExistsError(f"{folder} is the folder the model was loaded from ({source}): the export would "
                                f"replace the model it started from; nothing was written. Export to another folder")
    blocking = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ExportExistsError(f"{folder} is a file, not a folder: export to a folder" if blocking == folder else
                                f"{folder}: {blocking} is a file, not a folder; nothing was written. Export to a "
                                f"folder whose parents are folders")
    if not overwrite and holds_model(folder):
        raise ExportExistsError(f"{folder} already holds a model ({', '.join(p.name for p in model_files(folder))}); "
                                f"nothing was written. To replace it, {how}; or export to another folder")
    if holds_model(folder) and os.path.ismount(folder.resolve()):
        raise ExportExistsError(f"{folder} is a mount point holding a model, which cannot be swapped for the new "
                                f"export in one step; nothing was written. Export to a new folder inside it "
                                f"({folder / 'NAME'}), or move its model files away first")


def staging(folder: str | os.PathLike) -> Path:
    """A new, empty folder to write the export of ``folder`` into (of the folder a symlink ``folder`` leads to: that
    folder is the one replaced, and the link stays as it is): inside ``folder`` where it exists and holds no model
    (its files are then moved in, ``publish``; on its own disk, a mount point included), else beside it (to be
    renamed or swapped in). Leftovers of killed exports there are removed where they hold an export's files only
    (gigabytes, hidden), and named where they hold anything else (one killed while it put a replaced folder's
    files back holds the user's)."""
    folder = Path(folder).resolve()
    where = folder if folder.is_dir() and not holds_model(folder) else folder.parent
    where.mkdir(parents=True, exist_ok=True)
    prefix = f".{folder.name}.partial-"
    _clear_leftovers(where, prefix)
    staged = where / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(staged)
    return staged


def _clear_leftovers(where: Path, prefix: str) -> None:
    """Remove the staging folders of killed exports in ``where`` that hold nothing but an export's files (and whose
    process is gone); name the others, which may hold a replaced folder's files, in a warning."""
    kept = []
    for left in sorted(p for p in where.iterdir() if p.name.startswith(prefix) and p.is_dir()):
        if _alive(left.name[len(prefix):].removeprefix("old-").split("-")[0]):
            continue  # another export in flight
        ours = set(model_files(left))
        if all(p in ours or p.name.endswith(".tmp") for p in left.iterdir()):
            shutil.rmtree(left, ignore_errors=True)
        else:
            kept.append(left.name)
    if kept:
        warnings.warn(f"{where} holds {', '.join(kept)}, left by an export that was killed while it replaced a "
                      f"folder: the files there are that folder's. Move those you want into it, then remove it",
                      stacklevel=4)


def _alive(pid: str) -> bool:
    """Whether the process ``pid`` (a staging folder's) runs on this machine; True where that cannot be told."""
    if not pid.isdigit():
        return True
    if int(pid) == os.getpid():
        return False  # this process exports one folder at a time: the leftover is of a process before it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def publish(staged: Path, folder: str | os.PathLike) -> None:
    """Put the finished export ``staged`` (from ``staging``) at ``folder`` (see the module docstring): at the folder
    a symlink ``folder`` leads to. Before anything is replaced, a failure removes ``staged`` and leaves ``folder``
    as it was; after, nothing of the replaced folder is removed until every entry of the user's is back."""
    folder = Path(folder).resolve()
    try:
        old = _put_in_place(staged, folder)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    _sync_folder(staged.parent)  # the renames themselves on the disk (the folder's, or its parent's)
    if old is not None:
        _bring_back(old, folder)


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that cannot sync a folder (some network mounts): the rename is done all the same
    finally:
        os.close(fd)


def _put_in_place(staged: Path, folder: Path) -> Path | None:
    """Put ``staged`` at ``folder``; the replaced folder (now beside it), or None where none was replaced."""
    if staged.parent == folder:  # a folder without a model: never swapped (see the module docstring)
        _move_in(staged, folder)
        return None
    if not folder.exists():
        os.rename(staged, folder)
        return None
    if _exchange(staged, folder):
        return staged  # the swapped-out folder is now at the staging path
    old = folder.parent / f".{folder.name}.partial-old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(folder, old)
    try:
        os.rename(staged, folder)
    except OSError:
        os.rename(old, folder)  # the old model back where it was
        raise
    return old


def _move_in(staged: Path, folder: Path) -> None:
    """Move the export's files from ``staged`` (inside ``folder``) up into it: the weights first, ``config.json``
    last, so that until the last rename the folder holds no ``config.json`` (no model that looks whole). A failure
    takes the weights moved so far out again (they replaced nothing: the folder held none) and raises."""
    last = {INDEX_FILE: 1, "config.json": 2}
    entries = sorted(staged.iterdir(), key=lambda p: (last.get(p.name, 0), p.name))
    moved = []
    try:
        for entry in entries:
            os.replace(entry, folder / entry.name)
            moved.append(folder / entry.name)
        os.rmdir(staged)
    except BaseException:
        for path in moved:
            if path.name in last or path in set(stale_files(folder)):
                path.unlink(missing_ok=True)
        raise


def _bring_back(old: Path, folder: Path) -> None:
    """Move the user's entries of the replaced folder ``old`` into ``folder``, then remove ``old`` (the replaced
    model's files). An entry that cannot be moved is left in ``old``, which is then kept and named."""
    # A model's files come from the new export, never from the folder's past.
    drop = set(model_files(old)) - set(_tokenizer_kept(old, folder))
    stuck = []
    for entry in sorted(old.iterdir()):
        if entry in drop or (folder / entry.name).exists():
            continue
        try:
            os.rename(entry, folder / entry.name)
        except OSError as err:
            stuck.append(f"{entry.name} ({err.strerror or err})")
    if stuck:
        raise OSError(f"exported to {folder}, but these files of the folder it replaced could not be moved back into "
                      f"it: {', '.join(stuck)}. They are in {old}: move them into {folder} yourself, then remove "
                      f"{old}")
    shutil.rmtree(old, ignore_errors=True)


def _tokenizer_kept(old: Path, new: Path) -> list[Path]:
    """The replaced model's tokenizer files that stay beside an export that brings no tokenizer: where both models
    have one vocabulary size (the same model written again, say in another dtype), with a warning naming them; where
    the sizes differ, none (the tokenizer was the other model's), with a warning naming what goes."""
    if any((new / name).exists() for name in VOCAB_FILES):
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
