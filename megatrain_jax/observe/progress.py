"""What a person watching the run sees: a progress bar on a terminal, plain lines otherwise.

On a terminal the bar (step/total, loss, tokens/s, ETA) is redrawn in place with ``\\r`` at most ten
times a second, and a permanent line is printed for the first step the run trains (step 1, or the first of a
resumed run), every ``log_every`` steps, on evaluation steps and on skipped steps (a non-finite loss or gradient
norm), so the loss history stays on screen. Anywhere else (a log file, CI) only the lines are written.
"""

from __future__ import annotations

import collections
import shutil
import statistics
import sys
import time
from typing import TextIO

from megatrain_jax.fit import Hook
from megatrain_jax.flops import format_flops

_REDRAW_S = 0.1


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """Call it with each step's metrics (or use ``hook()``); ``close()`` ends the bar's line."""

    def __init__(self, total: int | None = None, log_every: int = 10, mode: str = "auto",
                 stream: TextIO | None = None):
        if mode not in ("auto", "bar", "lines", "off"):
            raise ValueError(f"progress mode must be 'auto', 'bar', 'lines' or 'off', got {mode!r}")
        self.stream = stream or sys.stdout
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.log_every = total, max(int(log_every), 1)
        self.show_bar = mode == "bar" or (mode == "auto" and tty)
        self.show_lines = mode != "off"
        self._tps: collections.deque[float] = collections.deque(maxlen=20)
        self._start: tuple[float, int] | None = None  # (time, step) of the first record: excludes compile
        self._drawn, self._last_draw = False, 0.0

    # ---------------------------------------------------------------- text
    def tokens_per_s(self) -> float:
        """Median of the recent steps' rates: robust to the odd slow (evaluation) or fast (last) step."""
        return statistics.median(self._tps) if self._tps else 0.0

    def eta_s(self, step: int) -> float | None:
        if self.total is None or self._start is None or step <= self._start[1]:
            return None
        t0, s0 = self._start
        return (time.perf_counter() - t0) / (step - s0) * max(self.total - step, 0)

    def _of_total(self, step: int) -> str:
        return f"{step:>6d}" + (f"/{self.total}" if self.total else "")

    def line(self, m: dict) -> str:
        parts = [f"step {self._of_total(m['step'])}", f"loss {m['loss']:.4f}"]
        if "aux_loss" in m:  # a routed model: the load-balancing term of the loss
            parts.append(f"(aux {m['aux_loss']:.4f})")
        if "grad_norm" in m:
            parts.append(f"grad_norm {m['grad_norm']:.3f}")
        if m.get("skipped"):
            parts.append("SKIPPED (loss or gradient norm not finite: no update)")
        if "lr" in m:
            parts.append(f"lr {m['lr']:.2e}")
        tps = self.tokens_per_s()
        parts.append(f"{tps:,.0f} tok/s")
        if m.get("tokens") and m.get("loss_tokens", m["tokens"]) < m["tokens"]:  # padding, prompts: out of the loss
            parts.append(f"({tps * m['loss_tokens'] / m['tokens']:,.0f} in the loss)")
        per_token = m["model_tflops"] / m["tokens_per_s"] if m.get("tokens_per_s") and "model_tflops" in m else None
        if per_token is not None:  # FLOP/s and MFU at the median rate, like tok/s
            parts.append(format_flops(tps * per_token))
            if "mfu" in m:
                parts.append(f"MFU {100 * m['mfu'] * tps / m['tokens_per_s']:.1f}%")
        parts += [f"{k} {v:.1f}" for k, v in m.items() if k.startswith(("h2d", "d2h")) and isinstance(v, float)]
        if "gpu_peak_gib" in m:
            parts.append(f"GPU peak {m['gpu_peak_gib']:.1f} GiB")
        eta = self.eta_s(m["step"])
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        return "  ".join(parts)

    @staticmethod
    def eval_line(m: dict) -> str:
        if "eval_pairs" in m:  # preference training: the objective on held-out pairs
            return (f"eval {m['step']:>6d}  eval_loss {m['eval_loss']:.4f}  reward accuracy "
                    f"{m['eval_rewards_accuracy']:.3f}  margin {m['eval_rewards_margin']:.3f}  "
                    f"({m['eval_pairs']:,} pairs, {m.get('eval_s', 0.0):.1f} s)")
        ppl = f"  ppl {m['eval_ppl']:.2f}" if "eval_ppl" in m else ""  # a hook of one's own may add eval_loss alone
        return (f"eval {m['step']:>6d}  eval_loss {m['eval_loss']:.4f}{ppl}  "
                f"({m.get('eval_tokens', 0):,} tokens, {m.get('eval_s', 0.0):.1f} s)")

    def bar(self, m: dict) -> str:
        width = shutil.get_terminal_size((100, 24)).columns
        eta = self.eta_s(m["step"])
        tail = (f" loss {m['loss']:.4f} | {self.tokens_per_s():,.0f} tok/s"
                + (f" | ETA {format_duration(eta)}" if eta is not None else ""))
        head = f"{self._of_total(m['step'])} "
        if self.total:
            frac = min(m["step"] / self.total, 1.0)
            cells = max(10, min(40, width - len(head) - len(tail) - 8))
            filled = int(frac * cells)
            head += f"[{'#' * filled}{'.' * (cells - filled)}] {100 * frac:3.0f}%"
        return (head + tail)[:width - 1]

    # ---------------------------------------------------------------- output
    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _clear_bar(self) -> None:
        if self._drawn:
            self._write("\r" + " " * (shutil.get_terminal_size((100, 24)).columns - 1) + "\r")
            self._drawn = False

    def print(self, text: str) -> None:
        """A permanent line (above the bar on a terminal)."""
        self._clear_bar()
        self._write(text + "\n")

    def __call__(self, m: dict, info=None) -> None:
        now = time.perf_counter()
        first = self._start is None  # step 1, or the first of a resumed run: a line at once, after compilation
        if first:
            self._start = (now, m["step"])
        if "tokens_per_s" in m:
            self._tps.append(m["tokens_per_s"])
        last = self.total is not None and m["step"] >= self.total
        if self.show_lines and (m["step"] % self.log_every == 0 or first or last or m.get("skipped")):
            self.print(self.line(m))
        if self.show_lines and "eval_loss" in m:
            self.print(self.eval_line(m))
        if self.show_bar and (now - self._last_draw >= _REDRAW_S or last):
            self._write("\r" + self.bar(m))
            self._drawn, self._last_draw = True, now

    def hook(self) -> Hook:
        return Hook(self, every=1)

    def close(self) -> None:
        if self._drawn:
            self._write("\n")
            self._drawn = False
