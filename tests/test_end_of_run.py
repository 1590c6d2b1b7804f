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

