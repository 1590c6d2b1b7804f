"""What a failed ``fit`` keeps, and what it says it kept: the history on the exception, the trained parameters
written back and (with checkpoints) saved where the engine's state is whole, and a note for each, naming the last
metrics row a failed write holds and the checkpoint beside it (``fit``'s docstring says when each applies)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from flax import nnx

from megatrain_jax.checkpoint.session import CheckpointedExit, CheckpointSession
from megatrain_jax.contract.layered import is_abstract

if TYPE_CHECKING:
    from megatrain_jax.fit import History


@dataclasses.dataclass
class FailedHook:
    """A hook that raised: the step whose metrics it failed on, the last step it took before (None: none in this
    call) and what it raised. It is given no more steps; the other hooks go on taking them."""

    step: int
    took: int | None
    error: Exception



def keep_what_was_trained(err: BaseException, phase: str, history: History, model: nnx.Module, write_back: bool,
                          session: CheckpointSession | None, failed: Sequence[FailedHook] = ()) -> None:
    """On the way out of a failed ``fit``: attach the history and, when the engine's state is whole (the
    failure came from a hook, the data or the checkpoint writer, or is a checkpointed stop), write the
    parameters back and save them; say on the exception what was kept. ``failed``: the hooks that raised."""
    eng, trained = history.engine, len(history)
    try:
        err.history = history
    except AttributeError:  # an exception type that takes no attributes
        pass
    if isinstance(err, CheckpointedExit):
        if write_back and not is_abstract(model):
            eng.write_back(model)
        return
    if trained:
        steps = (f"step {history.records[0]['step']}" if trained == 1 else
                 f"steps {history.records[0]['step']} to {history.records[-1]['step']}")
        if failed:  # metrics.jsonl is written by a hook: it has them only if its writer is not the one that failed
            failures = "; ".join(f"a hook failed on step {f.step}'s metrics and took none after "
                                 + (f"step {f.took}'s" if f.took is not None else "this run's start") for f in failed)
            notes = [f"fit: the metrics of {steps} were reported before the failure (from Python they are in "
                     f"err.history); {failures}; every other hook took them all (megatrain-jax train's metrics.jsonl "
                     f"in the run folder among them, unless its writer is a hook that failed)"]
        else:
            notes = [f"fit: the metrics of {steps} were reported before the failure (megatrain-jax train writes "
                     f"them to metrics.jsonl in the run folder; from Python they are in err.history)"]
    else:
        notes = ["fit: no step was reported before the failure"]
    wrote = next((f for f in failed if isinstance(f.error, OSError)), None)  # a hook whose write failed
    if phase == "engine":
        notes.append("the failure came from inside a training step, so the host state may be half-updated: "
                     "nothing was written back or saved; resume from the last committed checkpoint")
        committed = None if session is None else session.last_committed()
        if committed is not None:
            notes.append(f"the last committed checkpoint is {committed}")
    else:
        try:
            if write_back and not is_abstract(model):
                eng.write_back(model)
                notes.append(f"the parameters after step {eng.state.step} were written back to the model")
            if session is not None and wrote is not None:
                # a hook's write failed (metrics.jsonl, TensorBoard): a checkpoint now would be ahead of what it
                # wrote, and a resumed run's history would have a hole
                notes.append(_write_failed(wrote, session))
            elif session is not None and phase != "checkpoint":
                path = session.rescue(eng)
                reported = history.records[-1]["step"] if trained else session.start_step
                unreported = (f"; its metrics were never reported (the failure came first), so a run resumed "
                              f"from it has no metrics of step {eng.state.step}" if eng.state.step > reported else "")
                if path is not None and phase == "data" and isinstance(err, Exception):  # not an interrupt:
                    # the data's own failure, and a resumed run reads the same batches again
                    notes.append(f"the state after step {eng.state.step} was saved to {path}{unreported}; fix the "
                                 f"data first, then resume from it: a resumed run reads the same batch again")
                elif path is not None:
                    notes.append(f"the state after step {eng.state.step} was saved to {path}{unreported}; resume "
                                 f"from it")
                elif eng.state.step == session.start_step:
                    notes.append("no step was trained, so no checkpoint was saved: the same command, corrected, "
                                 "starts as this one did")
        except Exception as again:  # noqa: BLE001 - report the original failure, with this one noted
            notes.append(f"keeping the trained state failed too: {type(again).__name__}: {again}")
    for note in notes:
        err.add_note(note)


def _write_failed(wrote: FailedHook, session: CheckpointSession) -> str:
    """What a hook's failed write (``wrote``) left: the last step it holds, and the last checkpoint beside it
    (saved before the failure; one step ahead of the metrics when it was saved as the failed step's came in)."""
    held = wrote.took if wrote.took is not None else session.start_step
    where = f" ({wrote.error.filename})" if getattr(wrote.error, "filename", None) else ""
    said = (f"a hook's write failed{where} on step {wrote.step}'s metrics: it holds none after step {held}'s"
            if held else f"a hook's write failed{where} on step {wrote.step}'s metrics: it holds none")
    saved = session.last_committed()  # this run's last save, committed on the way out if still in flight
    at = int(saved.name) if saved is not None else session.start_step
    saved = saved or session.last_good()
    if saved is None:
        return f"{said}; there is no checkpoint to resume from"
    if at <= held:
        return f"{said}, and nothing was saved past what it wrote: the last checkpoint is {saved}: resume from it"
    missing = f"step {at}" if at == held + 1 else f"steps {held + 1} to {at}"
    return (f"{said}; the last checkpoint, {saved}, was saved before it failed (nothing was saved after it): resume "
            f"from it, and the resumed run's metrics have no row of {missing}")
