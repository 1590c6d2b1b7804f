"""The disk tier (``EngineConfig.disk_parts``): Adam moments of the last blocks in files, read ahead and
written behind. Training with it is bit for bit training without it; checkpoints copy the files, and a
run whose files were left mid-step resumes from its checkpoint exactly."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, TrainConfig, adamw, fit, preset
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.data import DataConfig
from megatrain_jax.engine.update.disk_tier import OnDisk
from megatrain_jax.engine.parts import PartId

from test_engine import TINY3, make_batches, run_both

pytestmark = pytest.mark.usefixtures("lib")  # the kernel must build: conftest.lib fails where it cannot

TX = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)  # noqa: E731


def _trained(engine_cfg, steps=3):
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), engine_cfg)
    for b in make_batches(steps, vocab=TINY3.vocab_size):
        engine.step([b]).resolve()
    engine.sync()
    return engine


def _arrays(engine) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves([(p.params, p.opt) for p in engine.state.parts])]


@pytest.mark.parametrize("extra", [{}, {"stream_dtype": "bfloat16"}, {"master_dtype": "bfloat16"},
                                   {"grads_on_gpu": 2, "micro_batches": 2}],
                         ids=["fp32", "bf16-stream", "capacity", "grads-on-gpu"])
def test_training_with_moments_on_disk_is_bitwise_training_without(tmp_path, extra):
    in_ram = _trained(EngineConfig(**extra))
    tiered = _trained(EngineConfig(disk_parts=2, disk_dir=str(tmp_path), **extra))
    assert tiered.disk_tier.parts == [PartId.block(1), PartId.block(2)]  # the last blocks
    moments = jax.tree.leaves((tiered.state[PartId.block(2)].opt.mu, tiered.state[PartId.block(2)].opt.nu))
    assert all(isinstance(x, OnDisk) for x in moments)
    assert not isinstance(jax.tree.leaves(tiered.state[PartId.block(0)].opt.mu)[0], OnDisk)
    for a, b in zip(_arrays(in_ram), _arrays(tiered)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert tiered.disk_tier.bytes_read > 0 and tiered.disk_tier.bytes_written > 0


def test_engine_with_moments_on_disk_equals_the_reference(tmp_path):
    run_both(TINY3, TX, EngineConfig(clip_norm=0.05, disk_parts=3, disk_dir=str(tmp_path)))


def test_round_trip_and_fresh_files_are_zeros_without_writing(tmp_path):
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), EngineConfig(disk_parts=1, disk_dir=str(tmp_path)))
    tier, part = engine.disk_tier, PartId.block(2)
    leaf = jax.tree.leaves(engine.state[part].opt.mu)[0]
    assert np.array_equal(np.asarray(leaf), np.zeros(leaf.shape, leaf.dtype))
    assert tier.bytes_written == 0  # created empty: the fill value is 0, no chunk written
    assert {p.name for p in tmp_path.rglob("*") if p.is_file()} == {"zarr.json", ".lock"}
    record = tier.load(part, engine.state[part])
    rng = np.random.default_rng(0)
    for x in jax.tree.leaves((record.opt.mu, record.opt.nu)):
        x[...] = rng.normal(size=x.shape).astype(x.dtype)
    expected = [x.copy() for x in jax.tree.leaves((record.opt.mu, record.opt.nu))]
    engine.state[part] = tier.store(part, record)
    got = [np.asarray(x) for x in jax.tree.leaves((engine.state[part].opt.mu, engine.state[part].opt.nu))]
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)
    # the bytes are in the files: read them with tensorstore alone
    import tensorstore as ts
    engine.sync()
    for marker, want in zip(jax.tree.leaves((engine.state[part].opt.mu, engine.state[part].opt.nu)), expected):
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / marker.key)}}
        np.testing.assert_array_equal(ts.open(spec).result().read().result(), want)


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="set disk_dir"):
        EngineConfig(disk_parts=1)
    with pytest.raises(ValueError, match="disk_parts=4 exceeds the 3 blocks"):
        Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), EngineConfig(disk_parts=4, disk_dir=str(tmp_path)))
    import optax
    with pytest.raises(ValueError, match="fused host kernel"):
        Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), optax.sgd(0.1), EngineConfig(disk_parts=1, disk_dir=str(tmp_path)))


CFG = preset("tiny", layers=3, vocab_size=128, hidden=32, ffn=64, heads=2, kv_heads=1)


def _fit(steps, ckpt, disk, **train):
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    data = DataConfig(seq_len=16, batch_size=2, seed=3, demo_tokens=1 << 14).build(CFG.vocab_size)
    cfg = EngineConfig(disk_parts=2, disk_dir=str(disk))
    h = fit(model, data, TX(), train=TrainConfig(steps=steps, log_every=0, checkpoint_dir=str(ckpt), **train),
            engine=cfg)
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}, h


def test_checkpoints_copy_the_files_and_a_resume_is_bit_exact(tmp_path):
    """Save at steps 2 and 3, then train on to 5: the files hold step 5's moments. A new run resumes from
    step 3's checkpoint (the files are rewritten from it) and ends where an uninterrupted run ends."""
    ref, ref_h = _fit(6, tmp_path / "ref", tmp_path / "disk_ref")
    _fit(3, tmp_path / "ckpt", tmp_path / "disk", checkpoint_every=2)
    _fit(5, tmp_path / "ckpt_scratch", tmp_path / "disk")  # the live files move on past the checkpoint
    got, h = _fit(6, tmp_path / "ckpt", tmp_path / "disk", resume=True)
    for k in ref:
        assert ref[k].tobytes() == got[k].tobytes(), k
    assert h["loss"] == ref_h["loss"][3:]
    # the checkpoint holds the moments themselves, not a reference to the files
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), TX())
    Checkpointer(tmp_path / "ckpt", read_only=True).restore(engine)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(engine.state[PartId.block(2)].opt.mu))


def test_a_failed_write_stops_training_instead_of_reading_stale_moments(tmp_path, monkeypatch):
    """A write that fails (a full disk, say) is not hidden by the next write of the same array: the next
    read of that part, and sync, raise DiskTierError naming the file."""
    from megatrain_jax.engine.update.disk_tier import DiskTierError
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), EngineConfig(disk_parts=1, disk_dir=str(tmp_path)))
    batches = make_batches(4, vocab=TINY3.vocab_size)
    engine.step([batches[0]]).resolve()
    engine.sync()
    tier = engine.disk_tier
    store = tier._stores["block_00002/nu_000"]

    class Full:  # the tensorstore array, whose writes fail
        def __getattr__(self, name):
            return getattr(store, name)

        def write(self, array):
            raise OSError(28, "No space left on device")

    monkeypatch.setitem(tier._stores, "block_00002/nu_000", Full())
    with pytest.raises(DiskTierError, match="block_00002/.* failed .*No space left on device.*resume from"):
        for b in batches[1:]:
            engine.step([b]).resolve()
        engine.sync()


def test_between_updates_only_the_next_steps_first_parts_are_read_ahead(tmp_path):
    """After a step's last write, the next step's first ``read_ahead`` tier parts are read (behind the
    writes, during the backward pass): no more moments in memory between steps than during the updates."""
    engine = _trained(EngineConfig(disk_parts=3, disk_dir=str(tmp_path)), steps=2)
    tier = engine.disk_tier
    assert list(tier._reads) == tier.parts[:tier.read_ahead] and tier.read_ahead < len(tier.parts)


def test_a_folder_serves_one_engine_at_a_time(tmp_path):
    cfg = EngineConfig(disk_parts=1, disk_dir=str(tmp_path))
    first = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), cfg)
    with pytest.raises(ValueError, match="is in use by another engine"):
        Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), cfg)
    first.close()  # deletes the files and frees the folder
    assert not tmp_path.exists()
    Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), cfg).close()


def test_a_restore_writes_each_part_before_taking_the_next(tmp_path, monkeypatch):
    """Restoring into a tier engine writes each part's moments before the next part arrives, so host
    memory holds one part's moments, not all of them queued."""
    import time
    _fit(2, tmp_path / "ckpt", tmp_path / "disk_a")
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), TX(), EngineConfig(disk_parts=2, disk_dir=str(tmp_path / "b")))
    tier = engine.disk_tier
    write = tier._write
    queued = []

    def slow_write(keys, arrays):
        write(keys, arrays)
        queued.append(sum(1 for f in tier._writes.values() if not f.done()))
        time.sleep(0.05)

    monkeypatch.setattr(tier, "_write", slow_write)
    Checkpointer(tmp_path / "ckpt", read_only=True).restore(engine)
    assert queued and max(queued) <= 1
