"""Where each GPU's time goes in a JAX profiler trace: compute kernels, collectives (NCCL), copies and idle.

    python experiments/trace_summary.py TRACE_DIR        # a jax.profiler.trace(..., create_perfetto_trace=True) dir

Reads the newest ``perfetto_trace.json.gz`` under the directory. For each GPU it takes the events of its
stream lines (threads whose name holds "Stream"), classifies each as a collective (``nccl`` in its name),
a copy (``memcpy``/``memset``) or compute (every other kernel), and reports, in milliseconds over the span
from the device's first to its last compute or collective kernel (copies outside it, e.g. a state copied
home after the step, do not count):

- ``compute_ms``, ``collective_ms``, ``copy_ms``: the union of each class's intervals (overlaps counted once);
- ``collective_exposed_ms``: collective time during which no compute kernel runs;
- ``idle_ms``: time with neither compute nor a collective running (copies alone count as idle: the compute
  engine is not working);
- ``top_collectives``: the collective kernels taking most time;
- ``compute_kinds_ms``: compute kernels' time summed by kind (attention, matrix products, XLA's other fusions, the
  rest; overlaps between streams counted twice), and ``top_kernels``: the compute kernels taking most time, with
  their calls;
- ``top_fusions``: the compute kernels that are neither matrix products nor attention (XLA's fusions, reductions,
  copies in kernels) taking most time, each named with its HLO module where the trace says (``name @ module``):
  where a block's time goes beside its products.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
from pathlib import Path


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union ``a`` not covered by the union ``b`` (both sorted, disjoint)."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            total += end - cursor
    return total


def classify(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "collective"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "compute"


KERNEL_KINDS = (("attention", ("fmha", "sdpa", "flash", "attention", "cudnn")),
                ("matmul", ("gemm", "xmma", "cutlass", "cublas", "matmul", "sm90_", "nvjet")),
                ("fusion", ("fusion", "triton")))


def kernel_kind(name: str) -> str:
    """A compute kernel's kind: attention (every cuDNN kernel: the block's only cuDNN calls, unless a flag gives
    cuDNN GEMM fusions too), matrix products (cuBLAS, CUTLASS, Triton GEMMs), XLA's other fusions, and the rest
    (gemv, split-K reductions among them): the first kind whose words the name holds."""
    low = name.lower()
    return next((k for k, words in KERNEL_KINDS if any(w in low for w in words)), "other")


def _kinds(by_name: collections.Counter) -> dict[str, float]:
    """Compute kernel time by kind (``kernel_kind``), names cut to 80 characters."""
    out = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["other"], 0.0)
    for name, us in by_name.items():
        out[kernel_kind(name)] += us
    return out


def summarize(trace_dir: str | Path) -> dict:
    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {"error": f"no perfetto_trace.json.gz under {trace_dir}"}
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpus = {pid: name for pid, name in processes.items() if "GPU" in name or "gpu" in name}
    out = {"file": files[-1].name, "devices": {}}
    for pid, gpu in sorted(gpus.items(), key=lambda kv: kv[1]):
        spans: dict[str, list] = collections.defaultdict(list)
        collectives: collections.Counter = collections.Counter()
        kernels_by_name: collections.Counter = collections.Counter()
        kernel_calls: collections.Counter = collections.Counter()
        fusions: collections.Counter = collections.Counter()
        fusion_calls: collections.Counter = collections.Counter()
        lines = collections.Counter()
        for e in events:
            if e.get("pid") != pid or e.get("ph") != "X":
                continue
            line = threads.get((pid, e.get("tid")), "")
            start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
            if "Stream" not in line:
                continue
            lines[line] += end - start
            kind = classify(e["name"])
            spans[kind].append((start, end))
            if kind == "collective":
                collectives[e["name"][:80]] += end - start
            elif kind == "compute":
                kernels_by_name[e["name"][:80]] += end - start
                kernel_calls[e["name"][:80]] += 1
                if kernel_kind(e["name"][:80]) in ("fusion", "other"):
                    module = (e.get("args") or {}).get("hlo_module")
                    key = e["name"][:80] + (f" @ {module}" if module else "")
                    fusions[key] += end - start
                    fusion_calls[key] += 1
        kernels = spans["compute"] + spans["collective"]
        if not kernels:
            out["devices"][gpu] = {"lines": sorted(set(threads.get((pid, t), "") for (p, t) in threads if p == pid))}
            continue
        first, last = min(a for a, _ in kernels), max(b for _, b in kernels)
        span = last - first
        clip = lambda ivs: [(max(a, first), min(b, last)) for a, b in ivs if b > first and a < last]
        compute, coll, copy = (_union(clip(spans[k])) for k in ("compute", "collective", "copy"))
        busy = _union(compute + coll)
        ms = lambda us: round(us / 1e3, 2)
        out["devices"][gpu] = {
            "span_ms": ms(span), "compute_ms": ms(_length(compute)), "collective_ms": ms(_length(coll)),
            "copy_ms": ms(_length(copy)), "collective_exposed_ms": ms(_minus(coll, compute)),
            "idle_ms": ms(span - _length(busy)),
            "stream_lines_ms": {k: ms(v) for k, v in lines.most_common(8)},
            "top_collectives": {k: ms(v) for k, v in collectives.most_common(6)},
            "compute_kinds_ms": {k: ms(v) for k, v in _kinds(kernels_by_name).items()},
            "top_kernels": {k: {"ms": ms(v), "calls": kernel_calls[k]} for k, v in kernels_by_name.most_common(12)},
            "top_fusions": {k: {"ms": ms(v), "calls": fusion_calls[k]} for k, v in fusions.most_common(24)},
        }
    return out


if __name__ == "__main__":
    print(json.dumps(summarize(sys.argv[1]), indent=1))
