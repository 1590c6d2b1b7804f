"""Host AdamW throughput (params/s): the engine's HostOptimizer on pinned-host arrays, the same update jitted
on the CPU backend, and torch's fused CPU AdamW (the bar issue 4 sets), all in one process, timed in
alternating rounds.

    PYTHONPATH=. python experiments/host_adam_bench.py --params 256 --out $OUT/host_adam.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # child.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax.engine.update.host_optimizer import HostOptimizer  # noqa: E402
from megatrain_jax.optim import adamw  # noqa: E402
from megatrain_jax.engine.transfer import Placement  # noqa: E402
from child import system_info  # noqa: E402


def make_jax_host(n: int, stream: bool, fused: bool = False, first_half: bool = False):
    """A step of the engine's HostOptimizer on pinned-host arrays (4 leaves of n/4 parameters)."""
    pl = Placement()
    tx = adamw(1e-4, weight_decay=0.1, mask=None) if fused else optax.adamw(1e-4, weight_decay=0.1)
    opt = HostOptimizer(tx, pl, jnp.bfloat16 if stream else None)
    assert opt.fused == fused, "fused kernel requested but unavailable"
    shapes = [(n // 4,)] * 4
    # the part's record as the engine builds it: fresh optimizer state, then each array where it lives
    state = {"part": opt.home(opt.fresh([jnp.full(s, 0.5, jnp.float32) for s in shapes]))}
    grads = pl.copy_to_host([jnp.full(s, 0.01, jnp.float32) for s in shapes])
    scale = 1.0  # the clip scale as the engine passes it: read on the host (StepDecision.scale_value)

    def step():
        if first_half:  # what the next forward waits on: the stream copy of the split update
            opt.update_stream(state["part"], grads, scale)
            return
        g = grads
        if pl.on_gpu and opt.route(state["part"]) == "host":  # the JAX path donates its inputs: fresh gradients
            g = pl.to_host(jax.tree.map(lambda x: x + 0, grads))
            jax.block_until_ready(g)
        state["part"] = opt.update(state["part"], g, scale)
        jax.block_until_ready(state["part"].params)
    return step


def make_jax_cpu_backend(n: int):
    cpu = jax.devices("cpu")[0]
    tx = optax.adamw(1e-4, weight_decay=0.1)
    p = [jax.device_put(np.full(n // 4, 0.5, np.float32), cpu) for _ in range(4)]
    g = [jax.device_put(np.full(n // 4, 0.01, np.float32), cpu) for _ in range(4)]
    o = jax.jit(tx.init)(p)
    upd = jax.jit(lambda p, o, g: (lambda u, o2: (optax.apply_updates(p, u), o2))(*tx.update(g, o, p)),
                  donate_argnums=(0, 1))
    st = {"p": p, "o": o}

    def step():
        st["p"], st["o"] = upd(st["p"], st["o"], g)
        jax.block_until_ready(st["p"])
    return step


def make_kernel_numpy(n: int):
    """The same kernel on ordinary (pageable) numpy memory: separates kernel speed from pinned memory."""
    from megatrain_jax.engine.update.host_kernel import adamw_numpy
    p, m, v, g = (np.full(n, x, np.float32) for x in (0.5, 0.0, 0.0, 0.01))
    hp = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=1.0, bc1=0.1, bc2=0.05)
    return lambda: adamw_numpy(p, m, v, g, None, **hp)


def make_quantized_kernel(n: int, moment_dtype: str, g_bf16: bool = False, defines: tuple[str, ...] = (),
                          part: str = "whole"):
    """A quantized-moment kernel (``moment_formats.FORMATS``: 8-bit, m7v5) on numpy arrays: bfloat16 p (uint16
    bits), uint8 codes of m and v with float32 scales per block, float32 (or bfloat16) g; n parameters as rows
    of 4096. ``defines``: the kernel built with those macros (``host_kernel.build``), e.g. without its AVX-512
    passes."""
    from megatrain_jax.engine.update.host_kernel import load, require
    from megatrain_jax.engine.update.moment_formats import FORMATS
    fmt, lib = FORMATS[moment_dtype], (load(defines) if defines else require(None))
    if lib is None:
        raise RuntimeError(f"the kernel built with {defines} is not available")
    shape = (n // 4096, 4096)
    p = np.full(shape, 0x3F00, np.uint16)  # 0.5 in bfloat16
    m, v = (np.zeros(fmt.codes_shape(shape, kind), np.uint8) for kind in ("m", "v"))
    m_absmax, v_absmax = (np.zeros(fmt.scale_shape(shape), np.float32) for _ in range(2))
    g = np.full(shape, 0x3C24, np.uint16) if g_bf16 else np.full(shape, 0.01, np.float32)  # 0.01 (rounded to bfloat16)
    hp = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=1.0, bc1=0.1, bc2=0.05)
    return lambda: fmt.inplace(lib, p.ctypes.data, m.ctypes.data, v.ctypes.data, m_absmax.ctypes.data,
                               v_absmax.ctypes.data, g.ctypes.data, shape[0], shape[1], block=fmt.block,
                               g_bf16=g_bf16, seed=0, offset=0, part=part, **hp)


def make_capacity_kernel(n: int):
    """Capacity mode's kernel on numpy arrays: bfloat16 p, m and v (uint16 bits), float32 g, all three written
    back with stochastic rounding."""
    from megatrain_jax.engine.update.host_kernel import adamw_sr_numpy
    p = np.full(n, 0x3F00, np.uint16)  # 0.5 in bfloat16
    m, v = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    g = np.full(n, 0.01, np.float32)
    hp = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, grad_scale=1.0, bc1=0.1, bc2=0.05)
    return lambda: adamw_sr_numpy(p, m, v, g, seed=0, **hp)


def make_torch(n: int):
    import torch
    p = [torch.nn.Parameter(torch.full((n // 4,), 0.5)) for _ in range(4)]
    for x in p:
        x.grad = torch.full_like(x, 0.01)
    return torch.optim.AdamW(p, lr=1e-4, weight_decay=0.1, fused=True).step


SYSTEMS = {
    "megatrain_jax_fused_kernel_fp32": lambda n: make_jax_host(n, False, True),
    "megatrain_jax_fused_kernel_with_bf16_copy": lambda n: make_jax_host(n, True, True),
    "megatrain_jax_fused_kernel_first_half": lambda n: make_jax_host(n, True, True, first_half=True),
    "fused_kernel_on_numpy_fp32": make_kernel_numpy,
    "megatrain_jax_capacity_kernel": make_capacity_kernel,
    "megatrain_jax_q8_kernel": lambda n: make_quantized_kernel(n, "q8"),
    "megatrain_jax_q8_kernel_bf16_grad": lambda n: make_quantized_kernel(n, "q8", g_bf16=True),
    # the same kernel built without its AVX-512 passes (its AVX2 ones): the two in one run
    "megatrain_jax_q8_kernel_bf16_grad_avx2": lambda n: make_quantized_kernel(n, "q8", g_bf16=True,
                                                                              defines=("MEGATRAIN_NO_AVX512",)),
    # one pass of the 8-bit update each (the stream pass writes p alone, the commit pass the codes alone)
    "megatrain_jax_q8_kernel_bf16_grad_stream": lambda n: make_quantized_kernel(n, "q8", g_bf16=True, part="stream"),
    "megatrain_jax_q8_kernel_bf16_grad_commit": lambda n: make_quantized_kernel(n, "q8", g_bf16=True, part="commit"),
    "megatrain_jax_m7v5_kernel_bf16_grad": lambda n: make_quantized_kernel(n, "m7v5", g_bf16=True),
    "megatrain_jax_m7v5_kernel_bf16_grad_avx2": lambda n: make_quantized_kernel(n, "m7v5", g_bf16=True,
                                                                                defines=("MEGATRAIN_NO_AVX512",)),
    "megatrain_jax_host_fp32": lambda n: make_jax_host(n, False),
    "megatrain_jax_host_with_bf16_copy": lambda n: make_jax_host(n, True),
    "jax_cpu_backend": make_jax_cpu_backend,
    "torch_fused_cpu_adamw": make_torch,
}


def interleaved(steps: dict, reps: int) -> dict:
    """Seconds per step of each system in every round, timed in rounds (A, B, C, A, B, C, ...) so that drift
    in the machine's memory bandwidth hits every system alike."""
    for fn in steps.values():
        fn()  # warm-up: first touch, compilation
    times = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return times


def _q8_vector_width() -> int | None:
    """The 8-bit kernel's vector width in the default build (16: AVX-512, 8: AVX2, 1: portable loops)."""
    from megatrain_jax.engine.update.host_kernel import load
    lib = load()
    return None if lib is None else lib.megatrain_q8_vector_width()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=256, help="millions of fp32 parameters")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (systems alternate within a round)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from: " + ", ".join(SYSTEMS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    n = args.params * 2**20
    names = args.systems.split(",")
    unknown = [x for x in names if x not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {unknown}; choose from {sorted(SYSTEMS)}")
    steps, runs, rounds = {}, {}, {}
    for name in names:
        try:
            steps[name] = SYSTEMS[name](n)
        except Exception as e:  # e.g. torch missing: recorded, not hidden
            runs[name] = f"error: {type(e).__name__}: {str(e)[:300]}"
    for name, secs in interleaved(steps, args.reps).items():
        runs[name], rounds[name] = n / statistics.median(secs), secs
    for name in names:
        print(name, runs[name], flush=True)
    commit = os.environ.get("MEGATRAIN_GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    dev = jax.devices()[0]
    out = {"name": "host_adamw_throughput", "command": "PYTHONPATH=. python experiments/host_adam_bench.py "
           + " ".join(sys.argv[1:] if argv is None else argv), "git_commit": commit,
           "device": {"name": getattr(dev, "device_kind", str(dev)), "cpu_cores": os.cpu_count()},
           "date": datetime.date.today().isoformat(), "params": n, "system_info": system_info(),
           "q8_vector_width": _q8_vector_width(),
           "runs": [{"system": k, "params_per_s": v if isinstance(v, float) else None,
                     "status": "ok" if isinstance(v, float) else v,
                     **({"seconds_per_round": [round(x, 6) for x in rounds[k]]} if k in rounds else {})}
                    for k, v in runs.items()]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
