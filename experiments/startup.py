"""Time from process start to the first finished step, with a cold and then a warm compilation cache.

    PYTHONPATH=. python experiments/startup.py --configs 3p5b_32k,7b_32k --out $OUT/h100_startup.json

For each configuration of experiments/bench.py, two fresh processes run one after the other on the same,
initially empty, compilation-cache folder (``MEGATRAIN_COMPILATION_CACHE``): the first finds it cold, the
second warm. Each process builds the engine as bench.py does (an abstract model initialized part by part,
seed 0) and runs one step. Its phases, in seconds:

- ``interpreter``: from this script starting the process to the process's first line;
- ``imports``: jax, flax, optax, megatrain_jax (from before ``import jax``);
- ``backend``: the pinned pool's cap from the memory plan (as ``megatrain-jax train`` sets it), then
  ``jax.devices()``, which starts the GPU client;
- ``state``: the abstract model and ``Engine(...)`` until the host state is in host memory;
- ``first_step``: the first batch, the step (compiling its programs, or loading them from the cache),
  its loss read on the host and its host updates done.

``time_to_first_step_s`` is their sum. Configurations run one at a time (7b_32k's state alone is about
100 GiB of host memory). ``--configs tiny_cpu`` smoke-tests the script on a CPU.

On a fresh virtual machine the first process to touch a range of host memory pays extra for it (≈ 0.2 s
per GiB on the H100 VMs, experiments/studies/NOTES.md): whichever run comes first would carry that cost.
``--pretouch-gib N`` first writes N GiB of host memory in throwaway processes, so that cold and warm runs
differ by the compilation cache alone.
"""

from __future__ import annotations

import time

T_START = time.time()  # the first line of a measured process: before any heavy import

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits",
                "/jax/compilation_cache/cache_misses": "cache_writes"}
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def host_rss_gib() -> float | None:
    """This process's resident memory now (Linux), pinned pool included."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None
    return round(kib / 2**20, 2)


def measure(config: str, spawned_at: float) -> dict:
    """One measured process: build the engine of ``config`` and run one step (called in a fresh process)."""
    t = {"start": T_START}
    import jax
    from jax._src import monitoring  # compile and cache counters (jax.monitoring's listeners)
    from flax import nnx

    sys.path.insert(0, REPO)
    sys.path.insert(0, HERE)
    import bench
    from megatrain_jax import Decoder, Engine, default_optimizer
    from megatrain_jax.data import TokenDataset, TokenFile
    from megatrain_jax.data.demo import demo_tokens
    from megatrain_jax.plan import fit_host_pool
    t["imports"] = time.time()

    counts = {"compiles": 0, "compile_s": 0.0, "cache_hits": 0, "cache_writes": 0}

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == COMPILE_EVENT:
            counts["compiles"] += 1
            counts["compile_s"] += seconds

    def on_event(event: str, **_) -> None:
        if event in CACHE_EVENTS:
            counts[CACHE_EVENTS[event]] += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)

    bc = bench.CONFIGS[config]
    cfg = bc.model()
    fit_host_pool(cfg, bc.engine, bc.rows, bc.seq_len)  # as megatrain-jax train does, before the GPU starts
    device = bench.device_info()
    t["backend"] = time.time()

    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    engine = Engine(abstract, default_optimizer(3e-4), bc.engine, seed=0)
    jax.block_until_ready(engine.state)
    t["state"] = time.time()
    compiles_state = dict(counts)
    rss_state = host_rss_gib()  # pinned pool (by doubling regions, capped) + pageable arrays: compare with state_gib

    tokens_per_step = bc.rows * bc.seq_len
    toks, starts = demo_tokens(cfg.vocab_size, 2 * tokens_per_step + bc.seq_len + 1, seed=0)
    batch = next(iter(TokenDataset(TokenFile.from_array(toks, cfg.vocab_size, starts), bc.seq_len).batches(bc.rows)))
    metrics = engine.step(batch).resolve()
    engine.policy.drain()  # the step's host updates are done too (sync() would also copy resident parts back)
    t["first_step"] = time.time()

    phases = {"interpreter": T_START - spawned_at, "imports": t["imports"] - t["start"],
              "backend": t["backend"] - t["imports"], "state": t["state"] - t["backend"],
              "first_step": t["first_step"] - t["state"]}
    return {"system": "megatrain_jax", "config": config, "device": device,
            "model": {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn, "heads": cfg.heads,
                      "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size, "params": cfg.param_count()},
            "seq_len": bc.seq_len, "tokens_per_step": tokens_per_step,
            "engine": dataclasses.asdict(bc.engine), "host_optimizer": engine.update_route,
            "state_gib": round(engine.state.nbytes() / 2**30, 2), "host_rss_after_state_gib": rss_state,
            "pinned_pool_limit_gib": os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"),
            "phases_s": {k: round(v, 3) for k, v in phases.items()},
            "time_to_first_step_s": round(t["first_step"] - spawned_at, 3),
            "compilation": {"during_state": compiles_state,
                            "during_first_step": {k: counts[k] - compiles_state[k] for k in counts}},
            "loss_first": metrics["loss"], "grad_norm_first": metrics["grad_norm"],
            "gpu_peak_gib": bench.gpu_peak_gib(), "host_peak_gib": bench.host_peak_gib(),
            "jax_version": jax.__version__, "status": "ok"}


def pretouch(gib: float, processes: int = 8) -> dict:
    """Write ``gib`` GiB of host memory (at most 90% of what is available) from throwaway processes side by
    side, then free it: the memory the measured processes get has been touched once."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20
    except (OSError, StopIteration):
        avail = gib
    gib = min(gib, 0.9 * avail)
    each = int(gib * 2**30 / processes) // 8
    code = f"import numpy as np; np.ones({each}, np.float64)"
    t = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]
    for p in procs:
        p.wait()
    return {"gib": round(each * 8 * processes / 2**30, 1), "s": round(time.time() - t, 2)}


def run_process(config: str, cache_dir: str, cache: str, timeout: float) -> dict:
    """``measure(config)`` in a fresh process on ``cache_dir``; the run's record, failures included."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # ours, not the user's
    env.update(MEGATRAIN_COMPILATION_CACHE=cache_dir, PYTHONUNBUFFERED="1")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    spawned_at = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", config, "--spawned-at", repr(spawned_at),
           "--result", result_path]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        process_s = time.time() - spawned_at  # to the process's exit: freeing pinned memory included
        with open(result_path) as f:
            text = f.read()
        run = json.loads(text) if text else {"system": "megatrain_jax", "config": config,
                                             "status": f"error: exit {proc.returncode}: {proc.stderr[-1500:]}"}
        run["process_exit_s"] = round(process_s, 3)
        notes = [line for line in proc.stderr.splitlines() if "compilation cache" in line.lower()]
        if notes:  # programs JAX could not write to or read from the cache, say
            run["cache_messages"] = notes[:20]
    except subprocess.TimeoutExpired:
        run = {"system": "megatrain_jax", "config": config, "status": f"error: timed out after {timeout:.0f} s"}
    finally:
        os.unlink(result_path)
    run["cache"] = cache
    entries = [os.path.join(d, n) for d, _, names in os.walk(cache_dir) for n in names]
    run["cache_folder_after"] = {"files": len(entries),
                                 "mib": round(sum(os.path.getsize(p) for p in entries) / 2**20, 2)}
    return run


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="3p5b_32k,7b_32k", help="comma-separated names from bench.py's CONFIGS")
    ap.add_argument("--out", help="path of the results JSON")
    ap.add_argument("--cache-root", default=None,
                    help="where to make the fresh cache folders (default: a temporary folder, removed after)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed to one measured process")
    ap.add_argument("--pretouch-gib", type=float, default=0.0,
                    help="first write this much host memory once, so no measured run pays a VM's first touch")
    ap.add_argument("--name", default=None)
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # internal: the measured process
    ap.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        try:
            run = measure(args.measure, args.spawned_at)
        except Exception as e:  # recorded, not hidden
            import traceback
            traceback.print_exc()
            run = {"system": "megatrain_jax", "config": args.measure,
                   "status": f"error: {type(e).__name__}: {str(e)[:500]}"}
        with open(args.result, "w") as f:
            json.dump(run, f)
        return None
    if not args.out:
        ap.error("--out is required")
    sys.path.insert(0, HERE)
    from bench import CONFIGS  # imports jax, which starts no GPU client: the measured processes own the GPU
    from child import pick_configs
    names = pick_configs(ap, args.configs, CONFIGS)
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip() or None
    result = {"name": args.name or f"startup_{'_'.join(names)}",
              "command": "PYTHONPATH=. python " + " ".join(["experiments/startup.py"] + (argv or sys.argv[1:])),
              "git_commit": commit, "device": None, "date": datetime.date.today().isoformat(), "runs": []}
    if args.pretouch_gib > 0:
        result["pretouch"] = pretouch(args.pretouch_gib)
        print(f"pretouched host memory: {result['pretouch']}", flush=True)
    root = args.cache_root or tempfile.mkdtemp(prefix="megatrain_startup_")
    try:
        for name in names:
            cache_dir = os.path.join(root, f"jax_cache_{name}")
            shutil.rmtree(cache_dir, ignore_errors=True)  # cold means empty
            os.makedirs(cache_dir)
            for cache in ("cold", "warm"):
                run = run_process(name, cache_dir, cache, args.timeout)
                result["device"] = result["device"] or run.pop("device", None)
                run.pop("device", None)
                result["runs"].append(run)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
                print(f"{name} {cache}: {run['status']} first step after {run.get('time_to_first_step_s')} s "
                      f"{run.get('phases_s')} compiles {run.get('compilation')}", flush=True)
    finally:
        if args.cache_root is None:
            shutil.rmtree(root, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
