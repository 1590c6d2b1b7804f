"""The end of a run in host memory: GPU-resident parts come home into their own host arrays, a leaf at a time,
once (experiments/studies/NOTES.md, 2026-11-28: the shipped h200_sft_8b was killed by the kernel at its end), and
never under a checkpoint still writing them."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, default_optimizer
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.engine.transfer import host_view
from test_checkpoint import CFG, data, engine_arrays, slow_writer


def leaves(part) -> list:
    return jax.tree.leaves((part.params, part.opt, part.stream))


@pytest.mark.parametrize("stream", [None, "bfloat16"], ids=["lean", "16-bit copy"])
def test_resident_parts_come_home_into_their_own_arrays_once(stream, monkeypatch):
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3),
                    EngineConfig(resident_layers=1, resident_io=True, stream_dtype=stream))
    assert engine.update_route == "fused"
    for batch in itertools.islice(data(), 2):
        engine.step(batch)
    engine.sync()  # the moments exist now (fresh ones are made at the first sync)
    engine.step(next(iter(data())))
    held = {part: leaves(engine.state[part]) for part in engine.resident_parts}
    engine.sync()
    for part in engine.resident_parts:
        host, device = engine.state[part], engine._resident[part]
        assert all(a is b for a, b in zip(leaves(host), held[part]))  # the same arrays, written in place
        for h, d in zip(jax.tree.leaves((host.params, host.opt)), jax.tree.leaves((device.params, device.opt))):
            assert np.array_equal(host_view(h), np.asarray(d))
    copies = []
    monkeypatch.setattr(engine.policy.opt, "home_into", lambda *a: copies.append(a))
    engine.parameters()  # already home since the last step: nothing copied again
    assert copies == []


def test_a_checkpoint_being_written_holds_the_resident_parts_until_it_has_them(tmp_path, monkeypatch):
    """A sync writes resident parts' host arrays in place: it waits at the checkpoint's gate, so the checkpoint
    is exactly the state at save."""
    slow_writer(monkeypatch, 0.3)
    batches = list(itertools.islice(data(), 3))
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), default_optimizer(1e-3),
                    EngineConfig(resident_layers=2, resident_io=True))  # every part: no host update waits
    for b in batches[:2]:
        engine.step(b)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(engine)
    at_save = engine_arrays(engine)
    engine.step(batches[2])
    after = engine_arrays(engine)  # syncs while the writer is still at work
    ckpt.close()
    assert any(not np.array_equal(at_save[k], after[k]) for k in at_save)
    fresh = Engine(Decoder(CFG, rngs=nnx.Rngs(1)), default_optimizer(1e-3),
                   EngineConfig(resident_layers=2, resident_io=True))  # every part: no host update waits
    Checkpointer(tmp_path, read_only=True).restore(fresh)
    got = engine_arrays(fresh)
    for k in at_save:
        assert np.array_equal(got[k], at_save[k]), k


# ------------------------------------------------------------------------------------------------ the plan
def test_the_plan_counts_the_end_of_the_run():
    """The end holds, beyond training's arrays, the most of: a resident leaf on its way home (pinned: what the
    pool's room does not hold), one exported tensor's cast copy, a checkpoint's save. The host total is the run's
    peak, start to exit."""
    from megatrain_jax import preset
    from megatrain_jax.engine import precision
    from megatrain_jax.hf.export import peak_bytes
    from megatrain_jax.plan import plan
    from megatrain_jax.plan.memory import CHECKPOINT_SAVE_BYTES, end_of_run
    cfg = preset("tiny", layers=4, vocab_size=4096, tie_embeddings=False)
    e = EngineConfig(resident_layers=2, resident_io=True, stream_dtype="float32")
    lean = precision.mode_of(e, cfg.dtype, "float32")
    home = 4 * cfg.vocab_size * cfg.hidden  # the embedding, the largest resident leaf, in float32
    assert end_of_run(cfg, e, lean, True, False, False)[1] == home
    assert end_of_run(cfg, e, lean, True, False, False, pool_room=home - 5)[1] == 5
    what, most = end_of_run(cfg, e, lean, True, True, True, pool_room=home)
    assert most == max(peak_bytes(cfg), CHECKPOINT_SAVE_BYTES) and "the Hugging Face export" in what
    assert end_of_run(cfg, EngineConfig(), lean, True, False, False) == ("", 0)  # nothing resident, no export
    p = plan(cfg, e, 4, 64, detect=False, export=True, checkpoints=True)
    room = p.host[next(k for k in p.host if k.startswith("XLA's pinned pool"))]
    end = [v for k, v in p.host.items() if k.startswith("end of run")]
    assert end == [max(home - room, peak_bytes(cfg), CHECKPOINT_SAVE_BYTES)]
    assert p.replace(seq_len=32).export and p.applied((("engine.micro_batches", 2),)).checkpoints  # levers keep it


def test_a_run_whose_end_would_not_fit_is_made_leaner_or_refused_before_training():
    from megatrain_jax import preset
    from megatrain_jax.plan import Machine, MemoryPlanError, plan, require_fit, resolve
    cfg = preset("tiny", layers=4, vocab_size=32768, hidden=256, ffn=512, tie_embeddings=False, dtype="bfloat16")
    e = EngineConfig()  # a 16-bit stream copy; nothing resident: the export is all the end holds
    without, with_ = (plan(cfg, e, 4, 64, detect=False, export=x) for x in (False, True))
    assert with_.host_total > without.host_total
    host = (without.host_total + with_.host_total) // 2  # training fits; its end does not
    machine = Machine(host_ram_bytes=host, gpu_bytes=None)
    assert resolve(cfg, e, 4, 64, machine).engine_cfg == e
    leaner = resolve(cfg, e, 4, 64, machine, export=True)
    assert leaner.engine_cfg != e and "host RAM is short" in leaner.said
    # a config that fixes its own host layout is refused, before training, with the end of the run in the table
    fixed = EngineConfig(stream_dtype="bfloat16")
    p = plan(cfg, fixed, 4, 64, detect=False, export=True)
    p = p.replace(host_ram_bytes=p.host_total - 1)
    with pytest.raises(MemoryPlanError, match="does not fit in host RAM(.|\n)*end of run"):
        require_fit(p)


def test_train_refuses_before_training_a_run_whose_export_would_not_fit(tmp_path, capsys, monkeypatch):
    """Host RAM enough for training but not for the export after it: ``train`` says so before the first step,
    with the end of the run in the plan's table, and leaves no run behind."""
    from megatrain_jax.cli.commands import main
    from megatrain_jax.cli.run_config import load_config
    from megatrain_jax.plan import machine, memory
    from test_cli import TINY_RUN
    wide = [*TINY_RUN, "model.vocab_size=32768", "model.hidden=256", "model.dtype=bfloat16",
            "engine.stream_dtype=bfloat16"]  # a host layout of the config's own: train picks no other
    cfg = load_config(None, wide)
    args = (cfg.model.build(), cfg.engine, cfg.data.batch_size, cfg.data.seq_len)
    without, with_ = (memory.plan(*args, host_ram_bytes=1000 * 2**30, detect=False, export=x) for x in (False, True))
    between = lambda: (without.host_total + with_.host_total) // 2  # noqa: E731
    monkeypatch.setattr(machine, "available_host_bytes", between)
    monkeypatch.setattr(memory, "available_host_bytes", between)
    run_dir = tmp_path / "run"
    status = main(["train", *wide, "train.steps=2", f"train.run_dir={run_dir}", f"train.export_hf={tmp_path / 'hf'}"])
    err = capsys.readouterr().err
    assert status != 0 and "does not fit in host RAM" in err and "end of run" in err and "Hugging Face export" in err
    assert not (run_dir / "metrics.jsonl").exists() and not (tmp_path / "hf").exists()
