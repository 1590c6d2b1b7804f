"""``check_model``: one call that tells whether a model follows the layered contract *and* trains the same
through the streamed engine as through plain ``jax.grad`` (``ReferenceTrainer``).

The contract checks (``megatrain_jax.contract.layered``) catch structural mistakes. What they cannot see is a model
whose ``__call__`` (read by the reference) and whose ``io.embed``/``blocks``/``io.unembed`` (read by the
engine) compute different functions, e.g. an ``embed`` that ignores ``positions_BT`` while ``__call__``
uses them. ``check_model`` trains copies of the model one step on a plain batch and one step on a packed
batch (two documents per row, positions restarting at the cut) both ways, and compares.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import traversals

from megatrain_jax.batch import Batch
from megatrain_jax.contract.layered import ContractError, is_abstract, layered, path_name
from megatrain_jax.reference import ReferenceTrainer

BATCH_KINDS = ("plain", "packed")


@dataclasses.dataclass(frozen=True)
class ModelCheck:
    """Engine vs reference after one optimizer step on each batch kind (``BATCH_KINDS``).

    Differences are relative: ``|engine - reference| / |reference|`` (for a parameter, of the norms).
    ``ok`` holds when every difference is at most ``tol``.
    """

    engine_losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    loss_rel_diff: float  # the largest over the batches
    grad_norm_rel_diff: float  # the largest over the batches
    param_rel_diff: float  # the largest over the parameters, after the last step
    param_path: str  # the parameter with that difference
    tol: float = 1e-4
    compute_dtype: str = "float32"  # model.cfg.dtype

    @property
    def loss_rel_diffs(self) -> tuple[float, ...]:
        """The loss difference of each batch kind."""
        return tuple(_rel(e, r) for e, r in zip(self.engine_losses, self.reference_losses))

    @property
    def ok(self) -> bool:
        diffs = (self.loss_rel_diff, self.grad_norm_rel_diff, self.param_rel_diff)
        return all(math.isfinite(d) and d <= self.tol for d in diffs)

    def __str__(self) -> str:
        head = ("check_model: OK, the engine and the reference trainer agree" if self.ok else
                "check_model: NOT OK, the engine and the reference trainer disagree")
        losses = "; ".join(f"{k} batch {e:.6g} vs {r:.6g} (relative difference {d:.2e})" for k, e, r, d in
                           zip(BATCH_KINDS, self.engine_losses, self.reference_losses, self.loss_rel_diffs))
        lines = [head,
                 f"  loss (engine vs reference): {losses}",
                 f"  gradient norm: relative difference {self.grad_norm_rel_diff:.2e}",
                 f"  parameters after the steps: largest relative difference {self.param_rel_diff:.2e} "
                 f"at {self.param_path}",
                 f"  tolerance {self.tol:.0e}"]
        if self.compute_dtype != "float32":
            lines.append(f"  The model computes in {self.compute_dtype}: rounding alone makes differences up to about "
                         f"1e-2, so only larger mistakes show. Check a float32 instance for a sharp test.")
        if not self.ok:
            lines.append("  The engine runs io.embed -> blocks -> io.final_hidden -> io.unembed; the reference "
                         "runs model(tokens, positions, segment_ids). Make them compute the same function"
                         + (" (only the packed batch differs: does io.embed or a block ignore positions_BT "
                            "or segment_ids_BT?)" if self._only_packed_differs() else "") + ".")
        return "\n".join(lines)

    def _only_packed_differs(self) -> bool:
        plain, packed = self.loss_rel_diffs
        return plain <= self.tol and not packed <= self.tol


def _batches(vocab_size: int, rows: int, seq_len: int, seed: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    plain = Batch.from_windows(rng.integers(0, vocab_size, (rows, seq_len + 1)))
    packed = Batch.from_windows(rng.integers(0, vocab_size, (rows, seq_len + 1)))
    cut = max(1, seq_len // 3)
    t = np.arange(seq_len)
    segment_ids = np.broadcast_to(np.where(t < cut, 1, 2), (rows, seq_len)).astype(np.int32)
    positions = np.broadcast_to(np.where(t < cut, t, t - cut), (rows, seq_len)).astype(np.int32)
    return [plain, Batch(packed.inputs, packed.targets, positions=positions, segment_ids=segment_ids)]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _largest_param_difference(engine_model: nnx.Module, reference_model: nnx.Module) -> tuple[float, str]:
    """``||e - r|| / max(||r||, 0.01 sqrt(size))`` per parameter, the largest and its path. The floor (an
    RMS of 0.01) keeps a parameter near zero (a bias after one step, or one whose true gradient is zero and
    which rounding noise alone moves) from turning noise into a large relative difference."""
    e = traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(engine_model, nnx.Param)))
    r = traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(reference_model, nnx.Param)))
    worst, where = 0.0, "(no parameters)"
    for path, ref in r.items():
        x, y = np.asarray(e[path], np.float64), np.asarray(ref, np.float64)
        rel = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 0.01 * math.sqrt(max(y.size, 1))))
        if not math.isfinite(rel) or rel > worst or where == "(no parameters)":
            worst, where = rel, path_name("model", path)
            if not math.isfinite(rel):
                break
    return worst, where


def check_model(model: nnx.Module, optimizer: optax.GradientTransformation | None = None, *,
                seq_len: int = 16, rows: int = 2, seed: int = 0, tol: float | None = None) -> ModelCheck:
    """Check that ``model`` (concrete, not changed) follows the layered contract and that the engine
    trains it exactly like the in-memory reference: one step of ``optimizer`` (default ``optax.sgd(0.1)``)
    on a plain and on a packed batch of ``rows`` x ``seq_len`` random tokens, in both trainers.

    Raises ContractError (unchanged) for a model that does not follow the contract. ``tol`` defaults to
    1e-4 for a float32 model (``model.cfg.dtype``) and 3e-2 for a 16-bit one, whose rounding differs
    between the two trainers (check a float32 instance where you can). The engine streams float32 weights
    here and matmuls run at full float32 precision (no TF32), so that only the model's own code differs.
    """
    from megatrain_jax import EngineConfig  # lazily: the engine imports this package's modules
    from megatrain_jax.engine.engine import Engine

    layered(model)  # the contract first: a ContractError (ours, with what to fix) reaches the caller as is
    if is_abstract(model):
        raise ValueError("check_model needs a concrete model (with parameter arrays), not an abstract one from "
                         "nnx.eval_shape: build a small concrete instance of the same class (e.g. with fewer "
                         "layers) and check that")
    cfg = model.cfg
    max_positions = getattr(cfg, "max_positions", None)
    if max_positions:
        seq_len = min(seq_len, int(max_positions))
    if seq_len < 2:
        raise ValueError(f"check_model needs seq_len >= 2 (a packed row holds two documents), got {seq_len}")
    if rows < 1:
        raise ValueError(f"check_model needs rows >= 1 (the rows of each batch it trains on), got {rows}")
    compute_dtype = str(jnp.dtype(getattr(cfg, "dtype", None) or "float32"))
    if tol is None:
        tol = 1e-4 if compute_dtype == "float32" else 3e-2
    optimizer = optimizer if optimizer is not None else optax.sgd(0.1)
    batches = _batches(cfg.vocab_size, rows, seq_len, seed)

    engine_model, reference_model = nnx.clone(model), nnx.clone(model)
    with jax.default_matmul_precision("highest"):
        config = EngineConfig(micro_batches=1, clip_norm=None, stream_dtype="float32")
        engine = Engine(engine_model, optimizer, config)
        reference = ReferenceTrainer(reference_model, optimizer, clip_norm=None)
        e_losses, r_losses, gnorm_diffs = [], [], []
        for kind, batch in zip(BATCH_KINDS, batches):
            e = _run(lambda: engine.step(batch).resolve(), "the engine (io.embed -> blocks -> io.unembed)", kind)
            r = _run(lambda: reference.step(batch), "the reference trainer (model.__call__)", kind)
            e_losses.append(float(e["loss"]))
            r_losses.append(float(r["loss"]))
            gnorm_diffs.append(_rel(float(e["grad_norm"]), float(r["grad_norm"])))
        engine.write_back(engine_model)
    loss_diffs = [_rel(a, b) for a, b in zip(e_losses, r_losses)]
    param_diff, param_path = _largest_param_difference(engine_model, reference_model)
    return ModelCheck(tuple(e_losses), tuple(r_losses), max(loss_diffs, key=_nan_last),
                      max(gnorm_diffs, key=_nan_last), param_diff, param_path, tol, compute_dtype)


def _run(fn, who: str, kind: str):
    """``fn()``; an error other than ContractError gets a note saying where it came from (same type)."""
    try:
        return fn()
    except ContractError:
        raise
    except Exception as e:
        e.add_note(f"check_model: raised while {who} ran the {kind} batch")
        raise


def _nan_last(x: float) -> float:
    """Sort key that makes a NaN the largest (so a NaN difference is reported, not hidden)."""
    return math.inf if not math.isfinite(x) else x
