"""Several devices: the engine over a mesh of 2 and 4 (forced) CPU devices must equal the single-device
engine and the in-memory reference, hold the state once (spread over the devices), and resume a
checkpoint across device counts. tests/conftest.py forces 4 CPU devices."""

from __future__ import annotations

import functools
import os
import tempfile

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, ReferenceTrainer, adamw, preset
from megatrain_jax.checkpoint.manager import Checkpointer
from megatrain_jax.models import MoEConfig
from megatrain_jax.engine.parts import IO
from megatrain_jax.engine.transfer import Placement
from test_engine import assert_models_close, make_batches

STEPS = 5
TOL = 1e-5
ADAMW = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)  # the fused kernel's optimizer


def devices(n):
    return jax.devices()[:n]


def train(n, cfg, engine_cfg, tx=ADAMW, steps=STEPS, batch_kw=None, model_seed=0):
    model = Decoder(cfg, rngs=nnx.Rngs(model_seed))
    engine = Engine(model, tx(), engine_cfg, devices=devices(n))
    k = engine_cfg.accumulate_steps
    batches = make_batches(steps * k, rows=8, vocab=cfg.vocab_size, **(batch_kw or {}))
    outs = [engine.step(batches[s * k:(s + 1) * k]).resolve() for s in range(steps)]
    engine.write_back(model)
    return engine, model, outs


def reference(cfg, engine_cfg, tx=ADAMW, steps=STEPS, batch_kw=None):
    ref = ReferenceTrainer(Decoder(cfg, rngs=nnx.Rngs(0)), tx(), clip_norm=engine_cfg.clip_norm)
    k = engine_cfg.accumulate_steps
    batches = make_batches(steps * k, rows=8, vocab=cfg.vocab_size, **(batch_kw or {}))
    outs = [ref.step(batches[s * k:(s + 1) * k]) for s in range(steps)]
    return ref.model, outs


TINY = preset("tiny", layers=3)  # hidden 64, vocab 256: every matrix spreads over 2 and 4 devices
ODD = preset("tiny", layers=2, vocab_size=97)  # a 97-row embedding does not divide: replicated

CASES = {
    "fused-f32": (TINY, EngineConfig(micro_batches=2), {}),
    "fused-bf16-stream": (TINY, EngineConfig(micro_batches=2, stream_dtype="bfloat16"), {}),
    "resident-accumulate": (TINY, EngineConfig(resident_io=True, resident_layers=1, accumulate_steps=2), {"mask": True}),
    # a block updated on the GPU beside a resident one, and the io part too: their state visits each device's shard,
    # gathered for the forward
    "gpu-updated-accumulate": (TINY, EngineConfig(resident_layers=1, gpu_updated_layers=1, gpu_updated_io=True,
                                                  accumulate_steps=2), {"mask": True}),
    "odd-shapes-packed": (ODD, EngineConfig(micro_batches=1, clip_norm=0.5), {"packed": True}),
    # a mixture of experts with its load-balancing loss: the routers' statistics summed over the devices
    "moe-aux-loss": (preset("tiny-moe").replace(moe=MoEConfig(experts=4, top_k=2, expert_ffn=48, aux_loss_coef=0.5)),
                     EngineConfig(micro_batches=2), {}),
}


@functools.cache
def one_device(case):
    """``CASES[case]`` trained on one device, once per process: the 2- and 4-device runs compare with the same run
    (and ``test_resume_across_device_counts`` with fused-f32's). Its placement, model and step outputs; not the
    engine, whose compiled programs would stay loaded."""
    cfg, engine_cfg, batch_kw = CASES[case]
    engine, model, outs = train(1, cfg, engine_cfg, batch_kw=batch_kw)
    return engine.placement, model, outs


@functools.cache
def case_reference(case):
    """``reference`` of ``CASES[case]``, once per process (the same for 2 and 4 devices)."""
    cfg, engine_cfg, batch_kw = CASES[case]
    return reference(cfg, engine_cfg, batch_kw=batch_kw)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_mesh_equals_one_device_and_reference(case, n):
    cfg, engine_cfg, batch_kw = CASES[case]
    one_placement, one_model, one_outs = one_device(case)
    many, many_model, many_outs = train(n, cfg, engine_cfg, batch_kw=batch_kw)
    assert many.placement.size == n and one_placement.size == 1
    # A bfloat16 stream computes each device's share of a gradient in bfloat16 (rounded per device, then
    # summed in float32): the same rounding noise as one device's, in another order. After 5 steps the
    # parameters differ by about 2.5e-3 relative (bfloat16's resolution is 7.8e-3); float32 agrees to 1e-5.
    tol, loss_tol = (TOL, TOL) if engine_cfg.stream_dtype is None else (1e-2, 1e-4)
    for a, b in zip(one_outs, many_outs):
        assert abs(a["loss"] - b["loss"]) <= loss_tol * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 10 * loss_tol * a["grad_norm"]
    assert_models_close(one_model, many_model, tol=tol)
    if engine_cfg.stream_dtype is None:  # the reference trains in float32 only
        ref_model, ref_outs = case_reference(case)
        for r, b in zip(ref_outs, many_outs):
            assert abs(r["loss"] - b["loss"]) <= TOL * abs(r["loss"])
        assert_models_close(ref_model, many_model, tol=TOL)


@pytest.mark.parametrize("tx, route", [(lambda: optax.adamw(1e-3, eps=1e-6), "host"),
                                       (lambda: optax.adafactor(1e-2), "device")])
def test_mesh_other_update_routes(tx, route):
    cfg = preset("tiny", layers=2)
    engine_cfg = EngineConfig(micro_batches=2)
    _, one_model, _ = train(1, cfg, engine_cfg, tx=tx, steps=3)
    many, many_model, _ = train(2, cfg, engine_cfg, tx=tx, steps=3)
    assert many.update_route == route
    assert_models_close(one_model, many_model, tol=TOL)


def test_state_is_held_once_spread_over_the_devices():
    engine, _, _ = train(4, TINY, EngineConfig(stream_dtype="bfloat16"), steps=1)
    placement = engine.placement
    kernel = engine.state.parts[1].params["attn"]["q"]["kernel"][...]  # pageable float32 masters
    assert isinstance(kernel, np.ndarray) and kernel.shape == (64, 64)
    stream = engine.state.parts[1].stream["attn"]["q"]["kernel"][...]  # pinned, one shard per device
    assert stream.sharding == placement.host_for(stream) and len(stream.addressable_shards) == 4
    assert {s.data.shape for s in stream.addressable_shards} == {(16, 64)}
    pinned = sum(s.data.nbytes for x in jax.tree.leaves(engine.state.parts) if isinstance(x, jax.Array)
                 for s in x.addressable_shards)
    one, _, _ = train(1, TINY, EngineConfig(stream_dtype="bfloat16"), steps=1)
    pinned_one = sum(x.nbytes for x in jax.tree.leaves(one.state.parts) if isinstance(x, jax.Array))
    assert pinned <= pinned_one * 1.02  # replicated leaves (norm scales, counts) are the only copies


def test_a_batch_that_does_not_split_over_the_devices_is_refused():
    engine = Engine(Decoder(TINY, rngs=nnx.Rngs(0)), ADAMW(), EngineConfig(micro_batches=2), devices=devices(4))
    with pytest.raises(ValueError, match="divisible by 8"):
        engine.step(make_batches(1, rows=4, vocab=256)[0])


def test_nonfinite_steps_are_skipped_on_every_device():
    model = Decoder(TINY, rngs=nnx.Rngs(0))
    engine = Engine(model, ADAMW(), EngineConfig(), devices=devices(2))
    good = make_batches(1, rows=8, vocab=256)[0]
    engine.step(good)
    engine.sync()
    io = engine.state[IO]  # the final norm's scale NaN: every device's loss is NaN (a NaN mask is refused)
    params = jax.tree.map(lambda a: a, io.params)
    nan = engine.placement.to_host(np.full((TINY.hidden,), np.nan, np.float32))
    old = params["final_norm"]["scale"]
    params["final_norm"]["scale"] = old.replace(nan) if hasattr(old, "replace") else nan
    engine.restore_part(IO, params, io.opt)
    engine.restored(engine.state.step)
    before = jax.tree.map(np.array, engine.state.params())
    out = engine.step(good).resolve()
    engine.sync()
    assert out["skipped"]
    after = jax.tree.map(np.array, engine.state.params())
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2), (4, 2)])
def test_resume_across_device_counts(tmp_path, saved, resumed):
    """Three steps on ``saved`` devices, checkpoint, two more on ``resumed`` devices: the same parameters as
    five uninterrupted steps on one device."""
    cfg, engine_cfg, _ = CASES["fused-f32"]
    batches = make_batches(5, rows=8, vocab=256)
    _, straight, _ = one_device("fused-f32")  # train(1, cfg, engine_cfg): five steps of these batches
    a = Engine(Decoder(cfg, rngs=nnx.Rngs(0)), ADAMW(), engine_cfg, devices=devices(saved))
    for b in batches[:3]:
        a.step(b)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(a, wait=True)
    model = Decoder(cfg, rngs=nnx.Rngs(7))
    b_ = Engine(model, ADAMW(), engine_cfg, devices=devices(resumed))
    ckpt.restore(b_)
    ckpt.close()
    assert b_.state.step == 3
    for b in batches[3:]:
        b_.step(b)
    b_.write_back(model)
    assert_models_close(straight, model, tol=TOL)


def test_placement_refuses_a_mesh_with_other_axes():
    mesh = jax.sharding.Mesh(np.array(devices(4)).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="one axis 'data'"):
        Placement(mesh=mesh)


def _launch_two_processes(out, *mode):
    """Start tests/multiprocess_worker.py as two jax.distributed processes; returns the Popen objects."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).with_name("multiprocess_worker.py")
    # the tests' persistent compilation cache (tests/conftest.py's), as tests/test_checkpoint.py's processes use it:
    # the four processes compile the same programs, and the model's initializers run before the engine would
    # turn on its own cache
    cache = os.environ.get("MEGATRAIN_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "megatrain_jax_test_cache"))
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    return [subprocess.Popen([sys.executable, str(worker), f"127.0.0.1:{port}", str(i), str(out), *map(str, mode)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]


def _pieces_of_two_processes(procs, out, like):
    """Wait for both processes; their losses and the parameters put together from each one's pieces."""
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    got = [np.full(r.shape, np.nan, np.float32) for r in like]
    losses = []
    for i in range(2):
        saved = np.load(f"{out}.{i}.npz")
        losses.append(saved["losses"])
        for name in saved.files:
            if name != "losses":
                n, start = map(int, name.split("_"))
                piece = saved[name]
                got[n][start:start + len(piece)] = piece if got[n].ndim else piece
    np.testing.assert_array_equal(losses[0], losses[1])  # the loss is global: both processes report it
    return losses[0], got


def test_two_processes_with_jax_distributed_equal_one_device_and_checkpoint_across_layouts(tmp_path):
    """Two processes on this machine (jax.distributed, gloo, 2 CPU devices each), each feeding its own rows:
    the same losses and parameters as one device trained on the whole batches. Checkpoints cross process
    layouts: the two processes save step 3 (each writing its own pieces) and one device resumes it; one
    device saves step 3 and the two processes resume it. Both give the uninterrupted run's parameters."""
    from mesh_case import ADAMW as TX, ENGINE, MODEL, batches

    # One device: five steps straight, and its step-3 checkpoint for the two processes to resume.
    engine = Engine(Decoder(MODEL, rngs=nnx.Rngs(0)), TX(), ENGINE, devices=devices(1))
    ckpt = Checkpointer(tmp_path / "one")
    losses = []
    for b in batches():
        losses.append(float(engine.step(b).loss))
        if engine.state.step == 3:
            ckpt.save(engine, wait=True)
    ckpt.close()
    engine.sync()
    ref = [np.asarray(x) for x in jax.tree.leaves(engine.state.params())]

    fresh = _launch_two_processes(tmp_path / "fresh", "save", tmp_path / "two")
    resumed = _launch_two_processes(tmp_path / "resumed", "resume", tmp_path / "one")
    for out, procs, want in ((tmp_path / "fresh", fresh, losses), (tmp_path / "resumed", resumed, losses[3:])):
        got_losses, got = _pieces_of_two_processes(procs, out, ref)
        np.testing.assert_allclose(got_losses, want, rtol=TOL)
        for n, (x, r) in enumerate(zip(got, ref)):
            assert np.linalg.norm(x - r) <= TOL * max(np.linalg.norm(r), 1e-30), n  # NaN: a piece no process had

    # The two processes' checkpoint, resumed on one device.
    model = Decoder(MODEL, rngs=nnx.Rngs(7))
    one = Engine(model, TX(), ENGINE, devices=devices(1))
    reader = Checkpointer(tmp_path / "two", read_only=True)
    reader.restore(one, 3)
    reader.close()
    for b in batches()[3:]:
        one.step(b)
    one.sync()
    for n, (x, r) in enumerate(zip(jax.tree.leaves(one.state.params()), ref)):
        assert np.linalg.norm(np.asarray(x) - r) <= TOL * np.linalg.norm(r), n