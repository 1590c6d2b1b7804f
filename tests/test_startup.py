"""Start-up (issue 13): the host state is built by one program per part kind, bit for bit what the earlier
per-part path gave, and the persistent compilation cache is on unless the user configured one."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax._src import monitoring

from megatrain_jax import Decoder, Engine, EngineConfig, adamw, preset
from megatrain_jax import _environment
from megatrain_jax.engine.update.host_optimizer import HostOptimizer
from megatrain_jax.engine.host_state import initial_state
from megatrain_jax.optim import AdamWState
from megatrain_jax.engine.parts import Part
from megatrain_jax.engine.transfer import Placement

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def count_compiles(fn) -> int:
    """XLA compilations (or persistent-cache loads) while ``fn()`` runs."""
    seen = []
    listener = lambda event, seconds, **_: seen.append(event) if event == COMPILE_EVENT else None
    monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        monitoring.unregister_event_duration_listener(listener)
    return len(seen)


def bf16_cfg(layers: int):
    return preset("tiny", layers=layers, dtype="bfloat16")  # a bfloat16 stream copy is built too


@pytest.mark.parametrize("tx", [adamw(1e-3), optax.adamw(1e-3)], ids=["fused", "optax"])
def test_engine_build_compiles_do_not_grow_with_layers(tx):
    config = EngineConfig(resident_layers=1, resident_io=True)
    build = lambda layers: Engine(nnx.eval_shape(lambda: Decoder(bf16_cfg(layers), rngs=nnx.Rngs(0))), tx, config)
    build(2)  # warms JAX's own caches (small helper programs), which every later engine shares
    few, many = count_compiles(lambda: build(2)), count_compiles(lambda: build(7))
    assert few == many, (few, many)
    assert many <= 12, many  # io + block init, the route check, resident loads and a few scalars


def _old_state(model, placement, opt: HostOptimizer, key):
    """The state as megatrain_jax built it before issue 13: masters per part by a jitted init written to
    pinned memory, moments from numpy zeros, the stream copy cast on the device and copied back."""
    make_io = jax.jit(lambda k: nnx.state(model.new_io(k), nnx.Param), out_shardings=placement.host)
    make_block = jax.jit(lambda k, i: nnx.state(model.new_block(i, k), nnx.Param), out_shardings=placement.host)
    masters = [make_io(key)] + [make_block(key, jnp.int32(i)) for i in range(len(model.blocks))]
    zeros = lambda p: placement.copy_to_host(np.zeros(p.shape, np.float32))
    return [(p, AdamWState(np.zeros((), np.int32), jax.tree.map(zeros, p), jax.tree.map(zeros, p)), opt.cast(p))
            for p in masters]


def _host_bits(tree):
    """Each leaf's dtype, shape and raw bytes: equal means bit for bit."""
    arrays = [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]
    return [(a.dtype, a.shape, a.tobytes()) for a in arrays]


def test_initial_state_is_bitwise_the_per_part_path():
    placement = Placement()
    model = nnx.eval_shape(lambda: Decoder(bf16_cfg(3), rngs=nnx.Rngs(5)))
    opt = HostOptimizer(adamw(1e-3), placement, jnp.bfloat16)
    key = nnx.Rngs(5).params()
    state = initial_state(model, placement, key, opt.fresh, opt.home, workers=3)
    old = _old_state(model, placement, opt, key)
    assert len(state.parts) == len(old) == 4 and state.step == 0
    for part, (params, moments, stream) in zip(state.parts, old):
        assert jax.tree.structure(part.opt) == jax.tree.structure(moments)
        for new, ref in [(part.params, params), (part.opt, moments), (part.stream, stream)]:
            assert _host_bits(new) == _host_bits(ref)
        assert_homes(part, placement, fused=True)


def assert_homes(part, placement, fused: bool):
    """Where each array of a host part lives: pinned what crosses PCIe (the stream copy, or the masters
    when they are streamed; the step count), pageable numpy what only the fused kernel touches."""
    pinned = lambda tree: all(isinstance(x, jax.Array) and x.sharding == placement.host for x in jax.tree.leaves(tree))
    pageable = lambda tree: all(isinstance(x, np.ndarray) and x.flags.writeable and x.flags.c_contiguous
                                for x in jax.tree.leaves(tree))
    if not fused:
        assert pinned(part)
        return
    assert pinned(part.opt.count) and pageable(part.opt.mu) and pageable(part.opt.nu)
    if part.stream is None:
        assert pinned(part.params)
    else:
        assert pageable(part.params) and pinned(part.stream)


def test_initial_state_of_a_concrete_model_copies_its_parameters():
    placement = Placement()
    model = Decoder(bf16_cfg(2), rngs=nnx.Rngs(1))
    opt = HostOptimizer(optax.adamw(1e-3), placement, jnp.bfloat16)
    state = initial_state(model, placement, None, opt.fresh, opt.home)
    io, blocks = state.params()
    for new, ref in zip(jax.tree.leaves([io] + blocks),
                        jax.tree.leaves([nnx.state(model.io, nnx.Param)] + [nnx.state(b, nnx.Param) for b in model.blocks])):
        np.testing.assert_array_equal(np.asarray(jax.device_get(new)), np.asarray(ref))
    ref_opt = optax.adamw(1e-3).init(nnx.state(model.blocks[0], nnx.Param))
    assert _host_bits(state.parts[1].opt) == _host_bits(ref_opt)
    for part in state.parts:
        assert_homes(part, placement, fused=False)  # XLA runs optax on the host: all of it pinned


def test_initial_state_buffers_never_alias():
    """The fused kernel writes masters, moments and stream copy in place: no two may share a buffer (XLA
    could hand one zero-filled buffer out twice), and none may alias a concrete model's arrays."""
    placement = Placement()
    model = Decoder(bf16_cfg(2), rngs=nnx.Rngs(0))
    opt = HostOptimizer(adamw(1e-3), placement, jnp.bfloat16)
    state = initial_state(model, placement, None, opt.fresh, opt.home)
    pointers = [a for x in jax.tree.leaves(state.parts) for at in placement.pieces(x).values() for a in at]
    pointers += [x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert len(pointers) == len(set(pointers))


def test_host_optimizer_fresh_keeps_the_masters_and_zeroes_moments():
    placement = Placement()
    opt = HostOptimizer(adamw(1e-3), placement, jnp.bfloat16)
    params = {"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)}
    part = jax.jit(opt.fresh, out_shardings=placement.host)(params)  # as initial_state runs it
    assert opt.fused and part.opt.mu is None and part.opt.nu is None  # the program computes no zeros
    part = opt.home(part)
    np.testing.assert_array_equal(np.asarray(jax.device_get(part.params["w"])), np.arange(6.0).reshape(2, 3))
    assert np.asarray(jax.device_get(part.opt.count)) == 0
    assert not part.opt.mu["w"].any() and not part.opt.nu["w"].any() and part.opt.mu["w"].shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(jax.device_get(part.stream["w"])).astype(np.float32),
                                  np.arange(6.0).reshape(2, 3))
    assert_homes(part, placement, fused=True)


@pytest.mark.parametrize("source", ["device", "pinned", "numpy"])
def test_home_copies_numpy_unless_adopted_and_keeps_pinned_arrays(source):
    placement = Placement()
    opt = HostOptimizer(adamw(1e-3), placement, jnp.bfloat16)
    w = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    put = {"device": placement.to_device, "pinned": placement.copy_to_host, "numpy": lambda x: x}[source]
    part = opt.home(jax.jit(opt.fresh, out_shardings=placement.host)({"w": jnp.asarray(w)}))
    given = Part(put(w), AdamWState(put(np.int32(3)), put(w + 1), put(w + 2)), put(w.astype(jnp.bfloat16)))
    for adopt in (False, True):
        homed = opt.home(given, adopt=adopt)
        assert_homes(homed, placement, fused=True)
        assert int(np.asarray(jax.device_get(homed.opt.count))) == 3
        np.testing.assert_array_equal(homed.opt.nu, w + 2)
        taken = homed.opt.mu is given.opt.mu
        assert taken == (adopt and source == "numpy"), (adopt, source)
        if source == "pinned":
            assert homed.stream is given.stream  # already where it lives: not copied
    assert part.opt.count.sharding == placement.host


def test_to_device_stages_pageable_leaves_one_at_a_time_on_a_gpu(monkeypatch):
    """On a GPU a part's numpy leaves go to the device through pinned memory one leaf at a time: each is staged,
    moved and waited for before the next is staged (the pinned pool's headroom holds one leaf, not a part's moments:
    7.8 GiB for 8B's io part); device leaves are moved together after; the values arrive unchanged."""
    import megatrain_jax.engine.transfer as transfer
    placement = Placement()
    monkeypatch.setattr(Placement, "on_gpu", property(lambda self: True))
    events = []
    copy, put = placement.copy_to_host, transfer._put
    monkeypatch.setattr(placement, "copy_to_host", lambda x: events.append(("stage", x.shape)) or copy(x))
    monkeypatch.setattr(transfer, "_put", lambda leaves, sh: events.append(("move", len(leaves))) or put(leaves, sh))
    wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: events.append(("wait", 1)) or wait(x))
    w = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    tree = {"m": w, "v": w + 1, "kept": jnp.ones(4), "n": np.full(2, 7, np.int32)}
    moved = placement.to_device(tree)
    assert [e[0] for e in events] == ["stage", "move", "wait"] * 3 + ["move"], events
    assert all(n == 1 for kind, n in events[:9] if kind == "move") and events[-1] == ("move", 1)
    np.testing.assert_array_equal(np.asarray(jax.device_get(moved["v"])), w + 1)
    np.testing.assert_array_equal(np.asarray(jax.device_get(moved["kept"])), np.ones(4))
    np.testing.assert_array_equal(np.asarray(jax.device_get(moved["n"])), [7, 7])
    assert all(moved[k].sharding == placement.device_for(tree[k]) for k in tree)


# ---------------------------------------------------------------- the persistent compilation cache
@pytest.fixture
def no_cache_configured(monkeypatch):
    """JAX's cache settings as a user who configured nothing; restored afterwards (the test suite's own
    cache, set in conftest.py, stays open: JAX opens the cache once per process)."""
    saved = {name: getattr(jax.config, name) for name in
             ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs", "jax_enable_compilation_cache")}
    jax.config.update("jax_compilation_cache_dir", None)
    for var in ("JAX_COMPILATION_CACHE_DIR", _environment.CACHE_VAR, "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_compilation_cache_defaults_to_a_per_user_folder(no_cache_configured, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = _environment.enable_compilation_cache()
    assert path == str(tmp_path / "megatrain_jax" / "jax_cache") == jax.config.jax_compilation_cache_dir
    assert os.path.isdir(path)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert _environment.enable_compilation_cache() == path  # idempotent


def test_compilation_cache_path_and_off_switch(no_cache_configured, monkeypatch, tmp_path):
    monkeypatch.setenv(_environment.CACHE_VAR, "0")
    assert _environment.enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(_environment.CACHE_VAR, str(tmp_path / "mine"))
    assert _environment.enable_compilation_cache() == str(tmp_path / "mine") == jax.config.jax_compilation_cache_dir


def test_compilation_cache_never_replaces_the_users(no_cache_configured, monkeypatch, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
    monkeypatch.setenv(_environment.CACHE_VAR, str(tmp_path / "ours"))
    assert _environment.enable_compilation_cache() == str(tmp_path / "users")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "from_env"))
    assert _environment.enable_compilation_cache() == str(tmp_path / "from_env")
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    jax.config.update("jax_enable_compilation_cache", False)
    assert _environment.enable_compilation_cache() is None


def test_engine_keeps_the_configured_cache():
    before = jax.config.jax_compilation_cache_dir  # the test suite's (conftest.py)
    Engine(Decoder(preset("tiny", layers=1), rngs=nnx.Rngs(0)), adamw(1e-3))
    assert jax.config.jax_compilation_cache_dir == before
