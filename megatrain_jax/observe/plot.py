"""A PNG of a run: training and evaluation loss, and throughput, against the step (matplotlib, optional)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from megatrain_jax.observe.metrics import read_metrics


def _numeric(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in records
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    if not pts:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pts)
    return np.asarray(steps), np.asarray(values, dtype=np.float64)


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (shorter at the start)."""
    c = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    return np.array([np.median(values[max(0, i - window + 1):i + 1]) for i in range(len(values))])


def _si(value: float, _pos=None) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= div:
            return f"{value / div:g}{suffix}"
    return f"{value:g}"


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write ``out`` (default ``run_dir/metrics.png``) from ``run_dir/metrics.jsonl``; returns its path.
    ``run_dir`` may also be a metrics file (``metrics.1.jsonl``, kept aside by a resumed run): ``out`` then
    defaults to the file's name with ``.png``."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'megatrain-jax[plot]' (or pip install "
                          "matplotlib)") from None
    source = Path(run_dir)
    if source.is_file() and source.suffix != ".jsonl":
        raise ValueError(f"{source} is a file, not a run folder: plot takes a run folder, the train.run_dir that "
                         f"holds metrics.jsonl (megatrain-jax plot {source.parent}), or a metrics .jsonl file")
    run_dir = source.parent if source.is_file() else source
    records = read_metrics(source)
    where = source / "metrics.jsonl" if source.is_dir() else source
    if not records:
        raise ValueError(f"{where} holds no records yet: a run writes one at the end of each step; plot it once the "
                         f"first step has trained")
    if not any(len(_numeric(records, key)[0]) for key in ("loss", "eval_loss", "tokens_per_s")):
        raise ValueError(f"{where} holds nothing to plot: none of its {len(records)} records has a finite loss, "
                         f"eval_loss or tokens_per_s (a run that diverged writes \"nan\" for them)")
    out = _png_path(out, source, run_dir)
    fig = plt.figure(figsize=(9, 7))
    try:
        _draw(fig, records, run_dir.name, matplotlib.ticker)
        try:
            fig.savefig(out, dpi=110)
        except OSError as err:
            raise OSError(err.errno, f"{err.strerror or err}: the plot cannot be written there; give another path "
                          f"(megatrain-jax plot RUN_DIR --out PATH)", str(out)) from err
    finally:
        plt.close(fig)  # also when drawing or writing failed: a caller that goes on keeps no open figure
    return out


def _png_path(out: str | os.PathLike | None, source: Path, run_dir: Path) -> Path:
    """Where the plot goes: ``out`` (``.png`` added where it names no format, as matplotlib does; a folder: the
    default name in it), else beside the metrics. Its folder must exist."""
    default = source.with_suffix(".png").name if source.is_file() else "metrics.png"
    if out is None:
        return run_dir / default
    folder = str(out).endswith(("/", os.sep))  # a trailing slash names a folder, even one not made yet
    out = Path(out)
    if out.is_dir() or folder:
        out = out / default
    elif not out.suffix:
        out = out.with_name(out.name + ".png")
    if not out.parent.is_dir():
        wrong = "is a file" if out.parent.exists() else "does not exist"
        raise FileNotFoundError(f"cannot write the plot to {out}: its folder {out.parent} {wrong}; create the folder "
                                f"or give another path")
    return out


def _draw(fig, records: list[dict], name: str, ticker) -> None:
    """Loss and eval loss (top), throughput (bottom), against the step."""
    ax_loss, ax_tps = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    steps, loss = _numeric(records, "loss")
    if len(loss):
        window = max(1, len(loss) // 50)
        ax_loss.plot(steps, loss, color="tab:blue", alpha=0.3 if window > 1 else 1.0, lw=1,
                     label="train loss" if window == 1 else None)
        if window > 1:
            ax_loss.plot(steps, _smooth(loss, window), color="tab:blue", lw=2,
                         label=f"train loss ({window}-step mean)")
    e_steps, e_loss = _numeric(records, "eval_loss")
    if len(e_loss):
        ax_loss.plot(e_steps, e_loss, "o-", color="tab:orange", lw=2, ms=5, label="eval loss")
    ax_loss.set_ylabel("loss (nats per token)")
    ax_loss.set_title(f"{name}: loss and throughput")
    ax_loss.grid(alpha=0.3)
    if len(loss) or len(e_loss):
        ax_loss.legend(loc="upper right")

    t_steps, tps = _numeric(records, "tokens_per_s")
    if len(tps):
        window = max(1, len(tps) // 30)
        ax_tps.plot(t_steps, tps, color="tab:green", lw=1, alpha=0.35 if window > 1 else 1.0,
                    label="tokens / s" if window == 1 else None)
        if window > 1:
            ax_tps.plot(t_steps, _rolling_median(tps, window), color="tab:green", lw=2,
                        label=f"tokens / s ({window}-step median)")
        ax_tps.yaxis.set_major_formatter(ticker.FuncFormatter(_si))
        # the first step (compilation) and the last (read as the loop drains) are outliers: scale to the bulk
        top = min(np.percentile(tps, 95), 3 * np.median(tps))
        ax_tps.set_ylim(0, 1.3 * top if top > 0 else 1.0)
        ax_tps.legend(loc="lower right")
    ax_tps.set_ylabel("throughput (tokens / s)")
    ax_tps.set_xlabel("step")
    ax_tps.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax_tps.grid(alpha=0.3)
    fig.tight_layout()
