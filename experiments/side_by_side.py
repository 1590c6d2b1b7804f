"""The whole comparison with the peers in one script run: every target measured on the same machine, one
results file (issue 4's targets; issue 12 raised the 7B bar to 450 model TFLOP/s; issue 51's: SlideFormer where
the model is streamed, plain GPU training where it fits, the step-time model's error on every run of ours).

    PYTHONPATH=/tmp/site:. python experiments/side_by_side.py --out $OUT/side_by_side.json

In order, each in its own process (so each starts with the host memory to itself):
1. host AdamW throughput: the engine's HostOptimizer as the engine runs it, the same fused kernel on
   ordinary numpy (pageable) arrays, and torch's fused CPU AdamW; and the host's memory bandwidth (a
   STREAM-style copy and triad on every core), the bar of the host update's bytes per second in the streamed
   runs (their ``breakdown.host_update``);
2. 3.5B at 8,192 tokens/step, where the model fits the GPU: megatrain_jax (bench.py ``3p5b_8k``: the plan picks
   the GPU-resident blocks), DeepSpeed ZeRO-3 offload (issue 33: small batches, where the host update bounds the
   step), and plain all-GPU training (experiments/plain_gpu.py, each remat policy, and
   experiments/peers/plain_torch.py, torch with fused AdamW in each of its settings: the better is the bar);
3. 3.5B at 32,768 tokens/step: the same three (``3p5b_32k``);
4. 3.5B with nothing resident (``streamed_8k``, ``streamed_32k``): megatrain_jax with every parameter streamed
   each step (``3p5b_8k_nothing_resident``, ``3p5b_32k_nothing_resident``), then SlideFormer
   (experiments/peers/slideformer_bench.py, which keeps no parameter on the GPU between steps), its run
   labelled with the same config;
5. 3.5B at 98,304 tokens/step: ours and ZeRO-3 (``3p5b_98k``);
6. 7B at 32,768 tokens/step (``7b_32k``): megatrain_jax alone (ZeRO-3 cannot hold 7B on a 125 GiB host);
7. not in the default ``--only``: ``sf_settings`` (run first where named), SlideFormer at 3.5B and 32K tokens
   with its switches (per-layer timers off, double buffering) alone and together, so that its best settings go
   into the other SlideFormer runs (``--sf-flags best`` takes them from the file); ``13b`` and ``13b_8k``, Llama-2-13B's shape on one H200 of a 251 GiB host
   (nvidia-h200-x2 with CUDA_VISIBLE_DEVICES=0), ours with the plan's layout against SlideFormer; ``13b_zero3``,
   ZeRO-3 at 13B and 32K tokens with its parameters and a fifth of its optimizer state on the GPU, at micro-batches
   of 16 and 8 rows (the faster is the bar; fully offloaded it does not fit that host).

SlideFormer's code is not in this repository: scripts/fetch_slideformer.sh brings it into .peers/slideformer
(git-ignored; carry it and .whl to the GPU machine, scripts/build_peer_wheels.sh). Where it is absent the script
stops before running anything, unless ``--skip-missing-peers`` (then those stages are left out, with a message).

All runs go into ``runs`` of the one file; ``targets`` then says, for each target of the issue, the
measured value, the bar, and whether it is met. ``--only`` runs a subset (e.g. ``--only 32k,host``).
Progress goes to stdout and to ``<out>.log``; the file is rewritten after every stage, so a run cut short
still leaves what it measured. The whole comparison takes about 15 minutes; where one command may last 10,
split it over calls on one machine with ``--resume`` (e.g. ``--only host,8k``, then ``--only 32k,98k
--resume``, then ``--only 7b --resume``, the same ``--out``): one file, its ``commands`` in order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
PEERS = {"slideformer": os.path.join(REPO, ".peers", "slideformer", "offload_transformer.py")}

# The bars (issue 33's for 8K, 32K, 7B and the host update; issue 4's for 98K and the GPU's idle share).
BARS = {"3p5b_8k": 5.0, "3p5b_32k": 2.2, "3p5b_98k": 1.5, "7b_tflops": 470.0, "host_optimizer": 1.2,
        "gpu_idle": 0.10}
# Issue 51's: ours over SlideFormer where the model is streamed (same config label on both runs), ours over the
# better plain all-GPU run where the model fits, and the step-time model's error on every run of ours.
SLIDEFORMER_BARS = {"3p5b_8k_nothing_resident": 1.2, "3p5b_32k_nothing_resident": 1.2, "13b_32k": 1.3,
                    "13b_8k": 2.5}
PLAIN_GPU_BAR = 0.95
# The scripts of the systems a run may leave out (--without).
SCRIPTS = {"zero3": "experiments/compare_zero3.py", "slideformer": "experiments/peers/slideformer_bench.py",
           "plain_jax": "experiments/plain_gpu.py", "plain_torch": "experiments/peers/plain_torch.py"}
PLAIN_SYSTEMS = ("plain_jax_gpu", "plain_torch_gpu")  # all-GPU JAX + optax (plain_gpu.py), torch (peers/plain_torch.py)
PREDICTION_BAR = 0.10
ZERO3_13B_BAR = 2.0
IDLE_CONFIGS = ("3p5b_8k", "3p5b_32k", "3p5b_98k", "7b_32k")
HOST_STREAM_BAR = 0.8  # the host update's bytes per second in the streamed runs, over the host's STREAM triad


# SlideFormer's own switches, each alone and together (the sf_settings stage, at 3.5B and 32K tokens): the fastest
# goes into the comparison's other SlideFormer runs with --sf-flags best
SF_SETTINGS = {"default": [], "no_timing": ["--no-timing"], "double_buffer": ["--double-buffer"],
               "no_timing_double_buffer": ["--no-timing", "--double-buffer"]}
SF_SETTINGS_CONFIG = "3p5b_32k_slideformer_"
SF_BEST = "@best"  # stands for the flags of the fastest sf_settings run until a SlideFormer run starts


def best_sf_flags(runs: list[dict]) -> tuple[list[str], str] | None:
    """The switches of the fastest sf_settings run in ``runs``, and its setting's name (None without one)."""
    timed = [r for r in runs if r.get("system") == "slideformer" and r.get("tokens_per_s")
             and str(r.get("config", "")).removeprefix(SF_SETTINGS_CONFIG) in SF_SETTINGS
             and str(r.get("config", "")).startswith(SF_SETTINGS_CONFIG)]
    if not timed:
        return None
    name = max(timed, key=lambda r: r["tokens_per_s"])["config"].removeprefix(SF_SETTINGS_CONFIG)
    return SF_SETTINGS[name], name


THIRTEEN_B = ["--layers", "40", "--hidden", "5120", "--ffn", "13824", "--heads", "40", "--kv-heads", "40",
              "--vocab", "32000"]  # Llama-2-13B's shape, as bench.py's llama2-13b preset


def stages(args, tmp_host: str) -> list[tuple[str, list[str]]]:
    bench = [PY, "experiments/bench.py", "--append", "--out", args.out, "--warmup", str(args.warmup),
             "--timeline-steps", "2"]
    ds = [PY, "experiments/compare_zero3.py", "--micro", "16", "--warmup", "2", "--steps", str(args.ds_steps),
          "--out", args.out]
    plain = [PY, "experiments/plain_gpu.py", "--append", "--warmup", "2", "--steps", str(args.ds_steps), "--out",
             args.out]  # the model fits the GPU: plain all-GPU training is the bar (issue 51)
    torch_plain = [PY, "experiments/peers/plain_torch.py", "--warmup", "2", "--steps", str(args.ds_steps),
                   "--liger-site", "/tmp/site_liger", "--out", args.out]  # the other plain bar: torch, fused AdamW
    sf = [PY, "experiments/peers/slideformer_bench.py", "--warmup", "2", "--steps", str(args.sf_steps),
          "--out", args.out, *([SF_BEST] if args.sf_flags == "best" else args.sf_flags.split())]
    return [  # first, not in the default --only: SlideFormer's settings at 3.5B and 32K tokens, nothing resident
        ("sf_settings", [PY, "experiments/peers/slideformer_bench.py", "--warmup", "2", "--steps", str(args.sf_steps),
                         "--out", args.out, "--layers", "16", "--rows", "16", *flags,
                         "--config", f"{SF_SETTINGS_CONFIG}{name}"]) for name, flags in SF_SETTINGS.items()] + [
        ("host", [PY, "experiments/host_adam_bench.py", "--params", str(args.host_params), "--reps", "15", "--systems",
                  "megatrain_jax_fused_kernel_fp32,megatrain_jax_fused_kernel_with_bf16_copy,"
                  "megatrain_jax_fused_kernel_first_half,fused_kernel_on_numpy_fp32,torch_fused_cpu_adamw",
                  "--out", tmp_host]),
        # the host's memory bandwidth (STREAM copy and triad) on every core, for the host update's bar
        ("host", [PY, "experiments/studies/host_update_profile.py", "--params", "256", "--reps", "3", "--threads",
                  str(len(os.sched_getaffinity(0))), "--out", tmp_host + ".stream.json"]),
        ("8k", bench + ["--configs", "3p5b_8k", "--steps", str(args.steps_8k)]),
        ("8k", ds + ["--layers", "16", "--rows", "4", "--micro", "4"]),
        ("8k", plain + ["--configs", "3p5b_8k"]),
        ("8k", torch_plain + ["--layers", "16", "--rows", "4"]),
        ("32k", bench + ["--configs", "3p5b_32k", "--steps", str(args.steps)]),
        ("32k", ds + ["--layers", "16", "--rows", "16"]),
        ("32k", plain + ["--configs", "3p5b_32k"]),
        ("32k", torch_plain + ["--layers", "16", "--rows", "16"]),
        # nothing resident (issue 51): ours with every parameter streamed each step, against SlideFormer
        ("streamed_8k", bench + ["--configs", "3p5b_8k_nothing_resident", "--steps", str(args.steps_8k)]),
        ("streamed_8k", sf + ["--layers", "16", "--rows", "4", "--config", "3p5b_8k_nothing_resident"]),
        ("streamed_32k", bench + ["--configs", "3p5b_32k_nothing_resident", "--steps", str(args.steps)]),
        ("streamed_32k", sf + ["--layers", "16", "--rows", "16", "--config", "3p5b_32k_nothing_resident"]),
        ("98k", bench + ["--configs", "3p5b_98k", "--steps", str(args.steps_98k)]),
        ("98k", ds + ["--layers", "16", "--rows", "48"]),
        ("7b", bench + ["--configs", "7b_32k", "--steps", str(args.steps)]),
        # where the model does not fit on the GPU (issue 51): 13B on one H200 of a 251 GiB host
        # (nvidia-h200-x2 with CUDA_VISIBLE_DEVICES=0); not in the default --only
        ("13b", bench + ["--configs", "13b_32k", "--steps", str(args.steps)]),
        ("13b", sf + ["--preset", "13b", "--rows", "16", "--config", "13b_32k"]),
        # ZeRO-3 at 13B (issue 51's bar: ours >= 2x its best settings where it fits the host). Everything offloaded
        # does not fit the 251 GiB host (killed after DeepSpeed's initialize,
        # h200x2_side_by_side_13b_zero3_db50998.json);
        # what fits: the parameters on the GPU with a fifth of the optimizer state there too (offload_optimizer.ratio,
        # DeepSpeed's partial offload), at micro-batches of 4 rows (4 accumulation steps: 2,107.8 tokens/s there,
        # GPU 62 GiB), 8 and 16 (one step), each peer at its best micro-batch; the bar takes the fastest. Its own
        # stage: each run takes ~3-4 minutes, most of it DeepSpeed's initialize.
        *[("13b_zero3", ds + THIRTEEN_B + ["--rows", "16", "--micro", str(micro), "--config", "13b_32k",
                                           "--ds-set", 'zero_optimization.offload_param.device="none"',
                                           "--ds-set", "zero_optimization.offload_optimizer.ratio=0.8"])
          for micro in (16, 8)],
        ("13b_8k", bench + ["--configs", "13b_8k", "--steps", str(args.steps_8k)]),
        ("13b_8k", sf + ["--preset", "13b", "--rows", "4", "--config", "13b_8k"]),
    ]


def _verdict(ratio: float, bar: float, ours: dict) -> dict:
    """A ratio's ``met``, and where our run had skipped timed steps (they ran no update: faster steps that train
    nothing) ``not_counted`` with the reason: such a run does not count."""
    n = ours.get("skipped_steps")
    return {"met": ratio >= bar and not n,
            **({"not_counted": f"{n} of our timed steps were skipped (non-finite loss or gradient norm): they ran "
                               f"no update"} if n else {})}


def _run(config: str, system: str, runs: list[dict]) -> dict | None:
    return next((r for r in runs if r.get("config") == config and r.get("system") == system), None)


def round_ratios(host_runs: dict, ours: str) -> dict:
    """The spread behind the host ratio: torch's time over ours in each round (the systems alternate within a
    round, so a round's pair saw the same machine); empty for a file written before rounds were recorded."""
    a = host_runs.get(ours, {}).get("seconds_per_round")
    b = host_runs.get("torch_fused_cpu_adamw", {}).get("seconds_per_round")
    if not a or not b or len(a) != len(b):
        return {}
    r = sorted(t / o for o, t in zip(a, b))
    return {"round_ratio_min": round(r[0], 3), "round_ratio_median": round(r[len(r) // 2], 3),
            "round_ratio_max": round(r[-1], 3)}


def targets(result: dict) -> dict:
    """Each target of issue 4: measured value, bar, met (None where a run is missing or failed)."""
    runs = result["runs"]
    out = {}
    for config in ("3p5b_8k", "3p5b_32k", "3p5b_98k"):
        ours, ds = _run(config, "megatrain_jax", runs), _run(config, "deepspeed_zero3", runs)
        if ours and ds and ours.get("tokens_per_s") and ds.get("tokens_per_s"):
            ratio = ours["tokens_per_s"] / ds["tokens_per_s"]
            out[f"{config}_vs_zero3"] = {"ours_tokens_per_s": ours["tokens_per_s"],
                                         "zero3_tokens_per_s": ds["tokens_per_s"], "ratio": round(ratio, 3),
                                         "bar": BARS[config], **_verdict(ratio, BARS[config], ours)}
    seven = _run("7b_32k", "megatrain_jax", runs)
    if seven and seven.get("model_tflops"):
        out["7b_32k_model_tflops"] = {"value": seven["model_tflops"], "bar": BARS["7b_tflops"],
                                      "met": seven["model_tflops"] >= BARS["7b_tflops"]}
    host_runs = {r["system"]: r for r in runs if r.get("config") == "host_adamw"}
    host = {k: r.get("params_per_s") for k, r in host_runs.items()}
    # issue 33's bar is on pageable memory, where the engine keeps the moments (and the masters it streams a
    # copy of); the kernel on pinned arrays is reported beside it
    pinned, torch = host.get("megatrain_jax_fused_kernel_fp32"), host.get("torch_fused_cpu_adamw")
    ours = host.get("fused_kernel_on_numpy_fp32", pinned)
    if isinstance(ours, float) and isinstance(torch, float):
        out["host_optimizer_vs_torch"] = {"ours_params_per_s": ours, "torch_params_per_s": torch,
                                          "ratio": round(ours / torch, 3), "bar": BARS["host_optimizer"],
                                          "met": ours / torch >= BARS["host_optimizer"],
                                          **({"pinned_ratio": round(pinned / torch, 3)}
                                             if isinstance(pinned, float) else {}),
                                          **round_ratios(host_runs, "fused_kernel_on_numpy_fp32"
                                                         if "fused_kernel_on_numpy_fp32" in host
                                                         else "megatrain_jax_fused_kernel_fp32")}
    # issue 4's idle bar is on its configs (streamed ones wait for the host update by design: their bars are
    # SlideFormer's and the host update's below)
    idled = [r for r in runs if r.get("system") == "megatrain_jax" and r.get("config") in IDLE_CONFIGS
             and "gpu_idle_fraction_est" in r.get("breakdown", {})]
    idle = {r["config"]: r["breakdown"]["gpu_idle_fraction_est"] for r in idled}
    if idle:
        # the bar is on the first figure, which counts the GPU-resident parts' update (device work) as idle
        beyond = {r["config"]: r["breakdown"].get("gpu_idle_beyond_device_update_est") for r in idled}
        out["gpu_idle_fraction"] = {"per_config": idle, "beyond_device_update": beyond, "bar": BARS["gpu_idle"],
                                    "met": all(v <= BARS["gpu_idle"] for v in idle.values())}
    for config, bar in SLIDEFORMER_BARS.items():
        ours, sf = _run(config, "megatrain_jax", runs), _run(config, "slideformer", runs)
        if ours and sf and ours.get("tokens_per_s") and sf.get("tokens_per_s"):
            ratio = ours["tokens_per_s"] / sf["tokens_per_s"]
            out[f"{config}_vs_slideformer"] = {
                "ours_tokens_per_s": ours["tokens_per_s"], "slideformer_tokens_per_s": sf["tokens_per_s"],
                "ratio": round(ratio, 3), "bar": bar, **_verdict(ratio, bar, ours),
                "ours_gpu_resident_param_share": (ours.get("predicted_step") or {}).get("resident_share"),
                "slideformer_gpu_resident_param_share": sf.get("gpu_resident_param_share")}
    for config in ("3p5b_8k", "3p5b_32k"):
        ours = _run(config, "megatrain_jax", runs)
        plain = [r for r in runs if r.get("config") == config and r.get("system") in PLAIN_SYSTEMS
                 and r.get("tokens_per_s")]
        if ours and ours.get("tokens_per_s") and plain:
            best = max(plain, key=lambda r: r["tokens_per_s"])  # the better of JAX + optax and torch
            ratio = ours["tokens_per_s"] / best["tokens_per_s"]
            out[f"{config}_vs_plain_gpu"] = {"ours_tokens_per_s": ours["tokens_per_s"],
                                             "plain_gpu_tokens_per_s": best["tokens_per_s"],
                                             "plain_gpu_system": best["system"],
                                             "plain_gpu_settings": best.get("remat_policy") or best.get("settings"),
                                             "plain_gpu_remat_policy": best.get("remat_policy"),
                                             "ratio": round(ratio, 3), "bar": PLAIN_GPU_BAR,
                                             **_verdict(ratio, PLAIN_GPU_BAR, ours)}
    ours, zero3 = _run("13b_32k", "megatrain_jax", runs), [r for r in runs if r.get("config") == "13b_32k"
                                                             and r.get("system") == "deepspeed_zero3"
                                                             and r.get("tokens_per_s")]
    if ours and ours.get("tokens_per_s") and zero3:
        best = max(zero3, key=lambda r: r["tokens_per_s"])
        ratio = ours["tokens_per_s"] / best["tokens_per_s"]
        out["13b_32k_vs_zero3_best"] = {"ours_tokens_per_s": ours["tokens_per_s"],
                                        "zero3_tokens_per_s": best["tokens_per_s"],
                                        "zero3_settings": best.get("ds_overrides") or best.get("command"),
                                        "ratio": round(ratio, 3), "bar": ZERO3_13B_BAR,
                                        **_verdict(ratio, ZERO3_13B_BAR, ours)}
    stream = _run("host_stream", "stream", runs)
    if stream and stream.get("triad_gb_per_s"):
        moved = {r["config"]: r["breakdown"]["host_update"]["gb_per_s"] for r in runs
                 if r.get("system") == "megatrain_jax" and r["config"] in SLIDEFORMER_BARS
                 and (r.get("breakdown") or {}).get("host_update", {}).get("gb_per_s")}
        if moved:
            share = {c: round(v / stream["triad_gb_per_s"], 3) for c, v in moved.items()}
            out["host_update_vs_stream"] = {"gb_per_s": moved, "stream_triad_gb_per_s": stream["triad_gb_per_s"],
                                            "share": share, "bar": HOST_STREAM_BAR,
                                            "met": all(v >= HOST_STREAM_BAR for v in share.values())}
    errors = {r["config"]: r["step_time_error"] for r in runs
              if r.get("system") == "megatrain_jax" and r.get("step_time_error") is not None}
    if errors:
        out["predicted_step_time"] = {"error_per_config": errors, "bar": PREDICTION_BAR,
                                      "met": all(abs(e) <= PREDICTION_BAR for e in errors.values())}
    out["all_met"] = bool(out) and all(v.get("met") for v in out.values() if isinstance(v, dict))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="host,8k,32k,streamed_8k,streamed_32k,98k,7b")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps of megatrain_jax at 32K")
    ap.add_argument("--steps-98k", type=int, default=4)
    ap.add_argument("--steps-8k", type=int, default=10, help="timed steps of megatrain_jax at 8K")
    ap.add_argument("--ds-steps", type=int, default=4)
    ap.add_argument("--sf-steps", type=int, default=6,
                    help="timed steps of SlideFormer (its 13B step varied 6.1-7.1 s over 4 timed steps on x2)")
    ap.add_argument("--sf-flags", default="",
                    help="SlideFormer's switches for every SlideFormer run of the comparison, as slideformer_bench.py "
                         "takes them (e.g. '--no-timing --double-buffer'); 'best': those of the fastest sf_settings "
                         "run in --out (that stage runs first, in this call or an earlier one with --resume)")
    ap.add_argument("--without", default="", help=f"comma-separated systems whose runs the stages leave out, from "
                                                  f"{sorted(SCRIPTS)} (e.g. zero3 where DeepSpeed is not installed)")
    ap.add_argument("--skip-missing-peers", action="store_true",
                    help="leave out the stages of a peer whose code is absent (default: stop before running anything)")
    ap.add_argument("--host-params", type=int, default=256, help="millions of parameters in the host AdamW run")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --out and add these stages' (one comparison split over several "
                         "calls on one machine, where a call may last at most 10 minutes)")
    args = ap.parse_args()
    wanted = set(args.only.split(","))
    without = {w for w in args.without.split(",") if w}
    if without - set(SCRIPTS):
        ap.error(f"--without: unknown systems {sorted(without - set(SCRIPTS))}; known: {sorted(SCRIPTS)}")
    missing = [name for name, path in PEERS.items() if not os.path.exists(path) and name not in without
               and any(st in wanted and f"peers/{name}_bench.py" in cmd[1] for st, cmd in stages(args, ""))]
    if missing:
        msg = (f"peer code absent: {', '.join(missing)} (no {', '.join(PEERS[m] for m in missing)}); bring it with "
               "`bash scripts/fetch_slideformer.sh` where github.com is reachable, then carry .peers/slideformer "
               "(and .whl) to the GPU machine")
        if not args.skip_missing_peers:
            sys.exit(f"side_by_side: {msg}; or pass --skip-missing-peers")
        print(f"side_by_side: skipping their stages: {msg}", flush=True)
    earlier = {}
    if os.path.exists(args.out):
        if args.resume:
            with open(args.out) as f:
                earlier = json.load(f)
        else:
            os.remove(args.out)
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(
        ["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    env = dict(os.environ, MEGATRAIN_GIT_COMMIT=commit or "", PYTHONPATH=os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), REPO) if p))
    log = open(args.out + ".log", "a" if args.resume else "w")
    tmp_host = args.out + ".host.json"
    host_runs: list[dict] = [r for r in earlier.get("runs", []) if r.get("config") in ("host_adamw", "host_stream")]
    commands = earlier.get("commands", [])
    commands = commands + ["PYTHONPATH=/tmp/site:. python experiments/side_by_side.py " + " ".join(sys.argv[1:])]
    wall_before = earlier.get("wall_s", 0.0)
    t_start = time.perf_counter()
    for stage, cmd in stages(args, tmp_host):
        if stage not in wanted or any(f"peers/{m}_bench.py" in cmd[1] for m in missing) or \
                any(cmd[1] == SCRIPTS[w] for w in without):
            continue
        if SF_BEST in cmd:
            done = json.load(open(args.out)).get("runs", []) if os.path.exists(args.out) else []
            best = best_sf_flags(done)
            if best is None:
                sys.exit(f"side_by_side: --sf-flags best needs the sf_settings stage's runs in {args.out}: run "
                         f"--only sf_settings first (or with this stage), or give the flags")
            cmd = [c for c in cmd if c != SF_BEST] + best[0]
            print(f"== SlideFormer's fastest setting in sf_settings: {best[1]} {' '.join(best[0])}", file=log,
                  flush=True)
        t = time.perf_counter()
        print(f"== [{time.perf_counter() - t_start:6.0f}s] {' '.join(cmd[1:])}", file=log, flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"== exit {proc.returncode} after {time.perf_counter() - t:.0f}s", file=log, flush=True)
        if stage == "host" and os.path.exists(tmp_host) and cmd[1] == "experiments/host_adam_bench.py":
            with open(tmp_host) as f:
                host = json.load(f)
            host_runs = [r for r in host_runs if r.get("config") != "host_adamw"] + [
                dict(r, config="host_adamw", params=host["params"]) for r in host["runs"]]
        if stage == "host" and os.path.exists(tmp_host + ".stream.json") and "host_update_profile" in cmd[1]:
            with open(tmp_host + ".stream.json") as f:
                stream = json.load(f)["runs"][0]["stream"]
            host_runs = [r for r in host_runs if r.get("config") != "host_stream"] + [
                {"system": "stream", "config": "host_stream", **stream}]
        if os.path.exists(args.out):
            with open(args.out) as f:
                result = json.load(f)
        elif host_runs:
            with open(tmp_host if os.path.exists(tmp_host) else tmp_host + ".stream.json") as f:
                result = {"device": json.load(f)["device"], "runs": []}
        else:
            continue
        result["runs"] = [r for r in result["runs"] if r.get("config") not in ("host_adamw", "host_stream")] + host_runs
        result.update(name=os.path.splitext(os.path.basename(args.out))[0], git_commit=commit,
                      command=" && ".join(commands), commands=commands, date=datetime.date.today().isoformat(),
                      wall_s=round(wall_before + time.perf_counter() - t_start, 1))
        result["targets"] = targets(result)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(json.load(open(args.out))["targets"] if os.path.exists(args.out) else {}, indent=1))


if __name__ == "__main__":
    main()
