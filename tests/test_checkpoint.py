"""Checkpoints: exact resume, asynchronous part-by-part snapshots, keep-last-N, corrupt and unfinished
checkpoints skipped, shape mismatches reported, save-then-exit on SIGTERM, and a SIGKILL during a save."""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import traversals

from megatrain_jax import Decoder, Engine, EngineConfig, Hook, TrainConfig, default_optimizer, fit, preset
from megatrain_jax.checkpoint.parts import MomentFormatWarning
from megatrain_jax.models.config import RopeScaling
from megatrain_jax.checkpoint import (Checkpointer, CheckpointWarning, CorruptCheckpointError, ShapeMismatchError,
                                      check_step, committed_steps)
from megatrain_jax.checkpoint.session import CheckpointedExit
from megatrain_jax.checkpoint.store import Snapshot
from megatrain_jax.data import DataConfig

ROOT = Path(__file__).resolve().parents[1]
CFG = preset("tiny", layers=2, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)  # as scripts/kill_during_save.py


def data(prefetch=0, batch_size=2):
    return DataConfig(seq_len=16, batch_size=batch_size, seed=3, prefetch=prefetch,
                      demo_tokens=1 << 14).build(CFG.vocab_size)


def params_of(model) -> dict:
    return {k: np.asarray(v) for k, v in
            traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def run(steps, ckpt=None, *, prefetch=0, config=EngineConfig(micro_batches=2), optimizer=None, hooks=(), **train):
    """A fresh model and data stream trained by ``fit``: returns (params, history)."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    train = TrainConfig(steps=steps, log_every=0, checkpoint_dir=None if ckpt is None else str(ckpt), **train)
    h = fit(model, data(prefetch), optimizer or default_optimizer(1e-3), train=train, engine=config, hooks=hooks)
    return params_of(model), h


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs"


def engine_arrays(engine) -> dict:
    engine.sync()
    s = engine.state
    return {jax.tree_util.keystr(p): np.array(v) for p, v in
            jax.tree_util.tree_flatten_with_path([(p.params, p.opt) for p in s.parts])[0]}


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted 6-step runs every resumed run must reproduce bit for bit."""
    return {"adamw": run(6), "sgd": run(6, optimizer=optax.sgd(0.1, momentum=0.9)),
            "accum": run(6, config=EngineConfig(micro_batches=2, accumulate_steps=2)),
            "bf16": run(6, config=EngineConfig(micro_batches=2, stream_dtype="bfloat16")),
            "resident": run(6, config=RESIDENT), "capacity": run(6, config=CAPACITY), "q8": run(6, config=Q8),
            "gpu_updated": run(6, config=GPU_UPDATED), "m7v5_two_pass": run(6, config=M7V5_TWO_PASS)}


# The io part and block 0 live on the device between saves: sync copies them to host, restore reloads them.
RESIDENT = EngineConfig(micro_batches=2, resident_layers=1, resident_io=True)
# Block 1 and the io part updated on the GPU (block 0 resident): each step's update of them runs at the next forward,
# so a save (a sync) runs it first, and a resume starts with none pending.
GPU_UPDATED = EngineConfig(micro_batches=2, resident_layers=1, gpu_updated_layers=1, gpu_updated_io=True)
# Capacity mode: bfloat16 masters and moments, stochastically rounded from bits keyed by the step (no RNG
# state to save).
CAPACITY = EngineConfig(micro_batches=2, master_dtype="bfloat16")
# ... with 8-bit moments (codes and per-block scales; here the embedding and head, the leaves of 4,096+
# elements) and bfloat16 gradients in host memory.
Q8 = EngineConfig(micro_batches=2, master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16")
# ... with 7-bit m and 5-bit v and the exact two-pass step: the layout train picks for 100B+ on a 512 GiB host.
M7V5_TWO_PASS = dataclasses.replace(Q8, moment_dtype="m7v5", norm_first=True)


# ---------------------------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("kind,prefetch", [("adamw", 0), ("adamw", 2), ("sgd", 0), ("accum", 2), ("bf16", 0),
                                           ("resident", 0), ("capacity", 0), ("q8", 0), ("gpu_updated", 0),
                                           ("m7v5_two_pass", 0)])
def test_resume_is_bit_exact(tmp_path, reference, kind, prefetch):
    """Stop at step 3, resume with a fresh model and data stream: every parameter and loss is identical.
    (``bf16``: the fused kernel's bfloat16 stream copies are not saved; the restore recomputes them.)"""
    kw = {"optimizer": optax.sgd(0.1, momentum=0.9)} if kind == "sgd" else {}
    if kind == "accum":
        kw["config"] = EngineConfig(micro_batches=2, accumulate_steps=2)
    if kind == "bf16":
        kw["config"] = EngineConfig(micro_batches=2, stream_dtype="bfloat16")
    if kind == "resident":
        kw["config"] = RESIDENT
    if kind == "capacity":
        kw["config"] = CAPACITY
    if kind == "q8":
        kw["config"] = Q8
    if kind == "gpu_updated":
        kw["config"] = GPU_UPDATED
    if kind == "m7v5_two_pass":
        kw["config"] = M7V5_TWO_PASS
    run(3, tmp_path, checkpoint_every=2, prefetch=prefetch, **kw)
    assert committed_steps(tmp_path) == [3, 2]
    params, h = run(6, tmp_path, resume=True, prefetch=prefetch, **kw)
    ref_params, ref_h = reference[kind]
    assert_same_params(params, ref_params)
    assert h["step"] == [4, 5, 6] and h["loss"] == ref_h["loss"][3:]
    config = json.loads((tmp_path / "6" / "config" / "config.json").read_text())
    assert config["model"]["hidden"] == CFG.hidden and config["engine"]["micro_batches"] == 2
    meta = json.loads((tmp_path / "6" / "meta" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["data"]["seed"] == 3 and meta["seed"] == 0


def test_sigterm_saves_then_exits_and_resumes_exactly(tmp_path, reference):
    before = signal.getsignal(signal.SIGTERM)
    kill_at_3 = Hook(lambda m, e: os.kill(os.getpid(), signal.SIGTERM) if m["step"] == 3 else None)
    with pytest.raises(CheckpointedExit) as exit_info:
        run(6, tmp_path, checkpoint_every=100, hooks=[kill_at_3])
    assert exit_info.value.code == 143 and exit_info.value.signal_name == "SIGTERM"  # 128 + SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # fit put the previous handler back
    # Metrics come one step late: when step 3 is reported, step 4 has run; it is reported too, then saved.
    assert committed_steps(tmp_path) == [4] and check_step(tmp_path / "4") is None
    assert exit_info.value.history["step"] == [1, 2, 3, 4]
    assert exit_info.value.history["loss"] == reference["adamw"][1]["loss"][:4]
    params, h = run(6, tmp_path, resume=True)
    assert_same_params(params, reference["adamw"][0])
    assert h["step"] == [5, 6] and h["loss"] == reference["adamw"][1]["loss"][4:]


def test_resume_from_an_explicit_checkpoint_path(tmp_path, reference):
    run(4, tmp_path / "a", checkpoint_every=2)
    params, _ = run(6, None, resume=str(tmp_path / "a" / "2"))  # restore only: no checkpoint_dir
    assert_same_params(params, reference["adamw"][0])


def test_resume_skips_consumed_batches_of_data_without_state(tmp_path, reference):
    """A plain list of batches has no state(): the resumed run skips the batches already consumed."""
    batches = list(itertools.islice(data(), 6))
    fit(Decoder(CFG, rngs=nnx.Rngs(0)), batches, default_optimizer(1e-3), engine=EngineConfig(micro_batches=2),
        train=TrainConfig(steps=3, log_every=0, checkpoint_dir=str(tmp_path)))
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    fit(model, batches, default_optimizer(1e-3), engine=EngineConfig(micro_batches=2),
        train=TrainConfig(steps=6, log_every=0, checkpoint_dir=str(tmp_path), resume=True))
    assert_same_params(params_of(model), reference["adamw"][0])


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    run(2, tmp_path, checkpoint_every=2)
    with pytest.raises(ValueError, match="resume to continue that run"):
        run(2, tmp_path)


def test_keeps_the_newest_n(tmp_path):
    run(5, tmp_path, checkpoint_every=1, checkpoint_keep=2)
    assert committed_steps(tmp_path) == [5, 4]


# ---------------------------------------------------------------------------------------- async snapshot
def slow_writer(monkeypatch, seconds):
    """The checkpoint writer sleeps ``seconds`` after each part it writes (a test-only delay)."""
    release = Snapshot.release

    def slow_release(self, name):
        release(self, name)
        time.sleep(seconds)
    monkeypatch.setattr(Snapshot, "release", slow_release)


def test_async_save_is_a_snapshot_while_training_goes_on(tmp_path, monkeypatch):
    """Training continues during a slow save; the engine (in-place fused AdamW on its update thread) is held
    before updating a part the writer has not written, so the checkpoint is exactly the state at save."""
    slow_writer(monkeypatch, 0.3)
    batches = list(itertools.islice(data(), 4))
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3))
    for b in batches[:2]:
        engine.step(b)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(engine)
    assert not (tmp_path / "2").exists()  # save() returned before the parts (0.3 s each) were written
    at_save = engine_arrays(engine)  # after save(): engine.sync() has run, no update is pending
    for b in batches[2:]:
        engine.step(b).resolve()
    after = engine_arrays(engine)
    assert engine.update_route == "fused" and ckpt.engine_wait_s > 0  # the update thread was held by the writer
    ckpt.close()
    assert any(not np.array_equal(at_save[k], after[k]) for k in at_save)  # training did move on
    fresh = Engine(Decoder(CFG, rngs=nnx.Rngs(1)), default_optimizer(1e-3))
    meta, _ = Checkpointer(tmp_path, read_only=True).restore(fresh)
    got = engine_arrays(fresh)
    assert meta["step"] == 2 and fresh.state.step == 2
    for k in at_save:
        assert np.array_equal(got[k], at_save[k]), k


def test_restore_places_arrays_in_pinned_host_and_recomputes_stream_copies(tmp_path):
    cfg = EngineConfig(stream_dtype="bfloat16")
    batches = list(itertools.islice(data(), 3))
    a = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-3), cfg)
    for b in batches[:2]:
        a.step(b)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(a, wait=True)
    b_ = Engine(Decoder(CFG, rngs=nnx.Rngs(5)), optax.adamw(1e-3), cfg)
    ckpt.restore(b_)
    ckpt.close()
    s = b_.state
    for leaf in jax.tree.leaves(s.parts):
        assert leaf.sharding == b_.placement.host
    for part in s.parts:
        assert part.stream is not None
        for m, x in zip(jax.tree.leaves(part.params), jax.tree.leaves(part.stream)):
            assert x.dtype == np.dtype("bfloat16") and np.array_equal(np.asarray(m).astype(x.dtype), np.asarray(x))
    assert float(b_.step(batches[2]).loss) == float(a.step(batches[2]).loss)


# ---------------------------------------------------------------------------------------- failure safety
def _corrupt(step_dir: Path, how: str) -> None:
    files = sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in p.as_posix())
    big = max(files, key=lambda p: p.stat().st_size)
    if how == "truncate":
        big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    elif how == "delete":
        big.unlink()
    elif how == "flip":
        raw = bytearray(big.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        big.write_bytes(bytes(raw))
    elif how == "manifest":
        (step_dir / "state" / "MANIFEST.json").unlink()
    elif how == "meta":
        (step_dir / "meta" / "meta.json").write_text('{"step": ')


@pytest.mark.parametrize("how", ["truncate", "delete", "flip", "manifest", "meta"])
def test_corrupt_checkpoint_is_detected(tmp_path, how):
    run(3, tmp_path, checkpoint_every=1)
    _corrupt(tmp_path / "3", how)
    assert check_step(tmp_path / "3") is not None and check_step(tmp_path / "2") is None
    with pytest.warns(CheckpointWarning, match=f"{tmp_path / '3'}"):
        assert Checkpointer(tmp_path, read_only=True).latest_complete() == 2
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-3))
    with pytest.raises(CorruptCheckpointError, match="cannot restore"):
        Checkpointer(tmp_path, read_only=True).restore(engine, 3)


def test_auto_resume_skips_a_corrupt_newest_checkpoint(tmp_path, reference):
    run(4, tmp_path, checkpoint_every=2)
    _corrupt(tmp_path / "4", "truncate")
    with pytest.warns(CheckpointWarning, match=f"skipping corrupt checkpoint {tmp_path / '4'}"):
        params, h = run(6, tmp_path, resume=True, checkpoint_every=2)
    assert h["step"] == [3, 4, 5, 6]  # resumed from step 2
    assert_same_params(params, reference["adamw"][0])
    # The corrupt one was moved aside, so step 4 could be written again.
    assert (tmp_path / "4.corrupt").is_dir() and committed_steps(tmp_path) == [6, 4, 2]


def test_unfinished_save_is_warned_about_and_removed_by_the_first_save(tmp_path):
    """A killed save's temporary folder is said when a writer opens the directory, and removed by its first save:
    a run refused before it saves (a resume that does not go ahead) leaves the directory as it was."""
    run(2, tmp_path, checkpoint_every=2)
    leftover = tmp_path / "3.orbax-checkpoint-tmp-1234567"
    (leftover / "state" / "io").mkdir(parents=True)
    with pytest.warns(CheckpointWarning, match=f"incomplete checkpoint {leftover}"):
        ckpt = Checkpointer(tmp_path)
    assert ckpt.latest_complete() == 2
    ckpt.close()
    assert leftover.exists()
    with pytest.warns(CheckpointWarning, match=f"incomplete checkpoint {leftover}"):
        run(4, tmp_path, resume=True, checkpoint_every=2)
    assert not leftover.exists() and committed_steps(tmp_path) == [4, 2]


def test_resuming_a_full_precision_checkpoint_in_capacity_mode_says_why_it_cannot(tmp_path):
    run(1, tmp_path, checkpoint_every=1)
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3), CAPACITY)
    with pytest.raises(ShapeMismatchError, match="another engine.master_dtype") as err:
        Checkpointer(tmp_path, read_only=True).restore(engine)
    assert "expected shape (128, 32) bfloat16, found shape (128, 32) float32" in str(err.value)


@pytest.mark.parametrize("written,resumed", [("capacity", "q8"), ("q8", "capacity"), ("capacity", "m7v5"),
                                             ("m7v5", "capacity"), ("m7v5", "q8"), ("q8", "m7v5")])
def test_moments_convert_between_bfloat16_and_quantized_on_restore(tmp_path, written, resumed):
    """A capacity-mode run resumed where ``train`` picks quantized moments (a smaller host), and back, and
    between 8-bit moments and m7v5: the moments are converted, with a warning, to what the written ones stand for
    (within a step of the coarser format: an eighth of the block's maximum in 8 bits, half of it in m7v5's v)."""
    configs = {"capacity": CAPACITY, "q8": Q8, "m7v5": dataclasses.replace(Q8, moment_dtype="m7v5")}
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    engine = Engine(model, default_optimizer(1e-3), configs[written])
    for batch in [next(iter(data()))] * 2:
        engine.step([batch])
    ckpt = Checkpointer(tmp_path)
    ckpt.save(engine, wait=True)
    ckpt.close()
    other = Engine(Decoder(CFG, rngs=nnx.Rngs(1)), default_optimizer(1e-3), configs[resumed])
    with pytest.warns(MomentFormatWarning, match="moments converted on restore"):
        Checkpointer(tmp_path, read_only=True).restore(other)
    from megatrain_jax.engine.update.host_optimizer import QuantizedMoment
    from megatrain_jax.engine.update.moment_formats import FORMATS

    def moments(e):  # each moment as float32 values, leaf by leaf
        e.sync()
        out = []
        for part in e.state.parts:
            structure = jax.tree.structure(part.params)
            for kind, tree in (("m", part.opt.mu), ("v", part.opt.nu)):
                for p, x in zip(jax.tree.leaves(part.params), structure.flatten_up_to(tree)):
                    out.append(FORMATS[e.cfg.moment_dtype].dequantize(x.codes, x.absmax, kind, p.shape)
                               if isinstance(x, QuantizedMoment) else np.asarray(x, np.float32))
        return out

    # of the largest value: a 1-bit mantissa (m7v5's v), a 3-bit one (8 bits)
    step = 0.51 if "m7v5" in {written, resumed} else 0.13
    converted = False
    for a, b in zip(moments(engine), moments(other)):
        scale = np.abs(a).max() + 1e-30
        assert a.shape == b.shape and np.abs(a - b).max() <= step * scale
        converted |= not np.array_equal(a, b)
    assert converted
    for a, b in zip(engine.state.parts, other.state.parts):  # the masters come back as written
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
            assert np.array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)))
    other.step([next(iter(data()))])  # and the run goes on


def test_moments_of_a_removed_format_are_refused_with_the_way_to_convert_them():
    """Codes of a format since removed (4-bit moments: two codes a byte, a scale per 128 elements) match no format
    on restore: the error names the removed formats and how to bring such a checkpoint over; a config that
    names one is refused with the formats to use instead."""
    from megatrain_jax.checkpoint.parts import _format_of
    with pytest.raises(ValueError, match="q4 or m8v4.*commit ebb2e98 in capacity mode"):
        _format_of(np.zeros((64, 128), np.uint8), np.zeros((64, 2), np.float32), (64, 256), "m")
    with pytest.raises(ValueError, match="removed.*Set it to 'm7v5'"):
        Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3), dataclasses.replace(Q8, moment_dtype="q4"))


def test_8bit_moments_are_saved_as_codes_and_scales(tmp_path, reference):
    """The 8-bit moments round-trip through a checkpoint as their codes and float32 scales, unchanged."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    engine = Engine(model, default_optimizer(1e-3), Q8)
    for batch in [next(iter(data()))] * 2:
        engine.step([batch])
    before = engine_arrays(engine)
    assert any(k.endswith(".codes") for k in before) and any(k.endswith(".absmax") for k in before)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(engine, wait=True)
    ckpt.close()
    other = Engine(Decoder(CFG, rngs=nnx.Rngs(1)), default_optimizer(1e-3), Q8)
    Checkpointer(tmp_path, read_only=True).restore(other)
    after = engine_arrays(other)
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and np.array_equal(before[k], after[k]), k


def test_shape_mismatch_lists_every_tensor(tmp_path):
    run(1, tmp_path, checkpoint_every=1)
    other = CFG.replace(hidden=48, layers=3)
    engine = Engine(Decoder(other, rngs=nnx.Rngs(0)), default_optimizer(1e-3))
    with pytest.raises(ShapeMismatchError) as err:
        Checkpointer(tmp_path, read_only=True).restore(engine)
    msg = str(err.value)
    assert "io/params.embedding.value: expected shape (128, 48) float32, found shape (128, 32) float32" in msg
    assert "io/opt.mu.embedding.value: expected shape (128, 48)" in msg
    assert "block_00000/params.attn.q.kernel.value: expected shape (48, " in msg
    assert "block_00002: missing from the checkpoint" in msg
    assert int(engine.state.step) == 0  # nothing was loaded


def test_a_changed_model_is_refused_with_overrides_that_put_it_back():
    """Fields that define the model are compared (a table key by key); how it is computed may change. The message's
    put-back overrides read back (as the command line reads them) to the checkpoint's values, lists and tables
    included, quoted for the shell where needed."""
    import shlex
    from megatrain_jax.checkpoint.session import check_same_model, jsonable
    from megatrain_jax.cli.toml_dataclass import parse_value
    saved = jsonable(CFG.replace(layer_types=("full_attention", "sliding_attention"), sliding_window=8,
                                 rope_scaling=RopeScaling(factor=4.0)))
    check_same_model(saved, {**saved, "dtype": "float32", "attention_impl": "xla", "max_positions": 64,
                             "loss_chunk_tokens": 7, "mlp_chunk_tokens": 5}, Path("ck/3"))
    now = {**saved, "layer_types": ["sliding_attention"] * 2, "rope_theta": 2e4,
           "rope_scaling": {**saved["rope_scaling"], "factor": 8.0}}
    with pytest.raises(ValueError) as err:
        check_same_model(saved, now, Path("ck/3"))
    msg = str(err.value)
    assert msg.startswith("cannot resume from ck/3: this run's model differs from the one the checkpoint holds")
    assert "  model.rope_scaling.factor: 4.0 in the checkpoint, 8.0 now" in msg
    back = msg.split("put the checkpoint's values back (")[1].split("). To train")[0]
    put_back = dict(item.split("=", 1) for item in shlex.split(back))
    assert {k: parse_value(v) for k, v in put_back.items()} == {
        "model.layer_types": ["full_attention", "sliding_attention"], "model.rope_theta": 10000.0,
        "model.rope_scaling.factor": 4.0}


def test_a_default_left_unset_and_the_same_value_set_are_the_same_model_on_resume():
    """head_dim unset or hidden // heads, the attention scalar unset or the head width, layer_types unset or one
    type per layer: the same model, so a resume goes on; a different explicit value is still refused, and its
    message gives the checkpoint's effective value to put back."""
    from megatrain_jax.checkpoint.session import check_same_model, jsonable
    saved = jsonable(CFG)
    assert saved["head_dim"] is None and saved["layer_types"] is None
    head = CFG.hidden // CFG.heads
    explicit = jsonable(CFG.replace(head_dim=head, query_pre_attn_scalar=float(head),
                                    layer_types=("full_attention",) * CFG.layers))
    check_same_model(saved, explicit, Path("ck/3"))
    check_same_model(explicit, saved, Path("ck/3"))
    with pytest.raises(ValueError, match=rf"model.head_dim: {head} in the checkpoint, {2 * head} now"):
        check_same_model(saved, jsonable(CFG.replace(head_dim=2 * head)), Path("ck/3"))
    with pytest.raises(ValueError, match="model.query_pre_attn_scalar"):
        check_same_model(saved, jsonable(CFG.replace(query_pre_attn_scalar=head / 2)), Path("ck/3"))
    # a field the model derives, set on neither side, or unread on one: only what it follows from is named and put
    # back (no "model.qk_norm_width=none", which the config parser refuses)
    for changed, named in ((dict(heads=4, kv_heads=2), "model.heads"), (dict(qk_norm=True), "model.qk_norm"),
                           (dict(sliding_window=8), "model.sliding_window")):
        with pytest.raises(ValueError) as err:
            check_same_model(saved, jsonable(CFG.replace(**changed)), Path("ck/3"))
        lines = [line for line in str(err.value).splitlines() if line.startswith("  model.")]
        assert [line.split(":")[0].strip() for line in lines] == [f"model.{k}" for k in changed], lines
        back = str(err.value).split("put the checkpoint's values back (")[1].split("). To train")[0]
        assert named in lines[0] and [b.split("=")[0] for b in back.split()] == [f"model.{k}" for k in changed]
    # a record one side cannot read as a DecoderConfig (a field since removed): both compared as stored, as before
    # (not one side's stored values against the other's effective ones)
    check_same_model({**saved, "removed_field": 1}, saved, Path("ck/3"))


def test_loading_runs_no_pickle():
    """Checkpoints are JSON and TensorStore (zarr/OCDBT) only: no pickle anywhere in the code that reads them."""
    for path in (ROOT / "megatrain_jax" / "checkpoint").glob("*.py"):
        text = path.read_text()
        assert "pickle" not in text.replace("no pickle", "").replace("unpickled", ""), path


# ---------------------------------------------------------------------------------------- a real crash
def _script(ckdir: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cache = os.environ.get("MEGATRAIN_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "megatrain_jax_test_cache"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1", **(env or {})}
    cmd = [sys.executable, str(ROOT / "scripts" / "kill_during_save.py"), "--dir", str(ckdir), "--steps", "6",
           "--every", "2", "--out", str(out), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("disk", [False, True], ids=["in-ram", "disk-tier"])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path, reference, disk):
    """A real training process is SIGKILLed while it writes step 4 (its writer sleeps after each part of it);
    the resumed process skips the unfinished save, restarts from step 2 and ends bit-exact. With the disk
    tier the killed run's moment files are left wherever it was; the resume rewrites them from step 2."""
    tier = ("--disk-dir", str(tmp_path / "tier")) if disk else ()
    victim = _script(tmp_path / "ck", tmp_path / "victim.npz", "--part-delay", "0.5", "--delay-from-step", "4", *tier)
    deadline = time.time() + 120
    while time.time() < deadline and not (committed_steps(tmp_path / "ck") and
                                          glob.glob(str(tmp_path / "ck" / "4.orbax-checkpoint-tmp*" / "**" / "io"),
                                                    recursive=True)):
        assert victim.poll() is None, victim.communicate()
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert committed_steps(tmp_path / "ck") == [2], "the kill was not during the save of step 4"
    assert glob.glob(str(tmp_path / "ck" / "4.orbax-checkpoint-tmp*"))
    resumed = _script(tmp_path / "ck", tmp_path / "resumed.npz", "--resume", *tier)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "incomplete checkpoint" in err and "4.orbax-checkpoint-tmp" in err
    assert f"resumed from {tmp_path / 'ck' / '2'}" in err
    ref_params, ref_history = reference["adamw"]  # the same run, uninterrupted, in this process
    got = np.load(tmp_path / "resumed.npz", allow_pickle=False)
    assert sorted(got.files) == sorted("/".join(map(str, k)) for k in ref_params)
    for k, v in ref_params.items():
        assert np.array_equal(got["/".join(map(str, k))], v), k
    assert json.loads((tmp_path / "resumed.json").read_text())["loss"] == ref_history["loss"][2:]
    assert committed_steps(tmp_path / "ck") == [6, 4, 2]


@pytest.mark.parametrize("resume", [None, "STEP3"])
def test_a_refused_checkpoint_session_closes_its_manager(tmp_path, monkeypatch, resume):
    """A session refused at construction (it would save over checkpoints it does not continue from) closes the
    checkpoint manager it opened: nothing is left waiting or holding the folder."""
    from megatrain_jax.checkpoint import session as session_module
    closed = []

    class Manager:
        def __init__(self, directory, keep=None):
            self.root = Path(directory)

        def close(self):
            closed.append(self.root)

    monkeypatch.setattr(session_module, "Checkpointer", Manager)
    monkeypatch.setattr(session_module, "committed_steps", lambda root: [3, 5])
    (tmp_path / "3").mkdir()
    with pytest.raises(ValueError, match="already holds checkpoints" if resume is None else "newer checkpoints"):
        session_module.CheckpointSession(tmp_path, resume=None if resume is None else tmp_path / "3")
    assert closed == [tmp_path]
