"""The precision table (``megatrain_jax.engine.precision``) against what an engine in each mode allocates: the
masters, the moments, the stream copy and the gradients that come home are of the dtypes and bytes the record
says, the weights cross PCIe as it says, and the memory plan counts the same bytes. A record that lied about
any of them fails here; a new mode is a new line of ``CASES``."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, adamw
from megatrain_jax.engine import precision
from megatrain_jax.engine.update.host_optimizer import QuantizedMoment
from megatrain_jax.plan.counts import host_grad_bytes, moment_bytes

from test_engine import TINY3, make_batches

pytestmark = pytest.mark.usefixtures("lib")  # the kernel must build: conftest.lib fails where it cannot

CFG = TINY3.replace(dtype="bfloat16")
CASES = {  # one engine config per mode, as a user would set it (gradients home in the mode's default dtype)
    "full": EngineConfig(),
    "lean": EngineConfig(stream_dtype="float32"),
    "capacity": EngineConfig(master_dtype="bfloat16"),
    "q8": EngineConfig(master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16"),
    "m7v5": EngineConfig(master_dtype="bfloat16", moment_dtype="m7v5", host_grad_dtype="bfloat16"),
}


def test_every_mode_has_a_case():
    assert set(CASES) == set(precision.MODES)


def _nbytes(tree) -> int:
    return sum(int(np.asarray(x).nbytes) if isinstance(x, np.ndarray) else x.nbytes for x in jax.tree.leaves(tree))


class _Traffic:
    """The trees each fetch sends to the device and each ``send_grads`` brings home."""

    def __init__(self):
        self.to_gpu, self.home = {}, {}

    def on_op(self, op, start, end, out):
        if op.kind == "fetch":
            self.to_gpu[op.part] = out
        elif op.kind == "send_grads":
            self.home[op.part] = out

    def on_task(self, *a, **k):
        pass


def _run(cfg: EngineConfig) -> tuple[Engine, _Traffic]:
    """An engine in ``cfg``'s mode after one step, and what crossed PCIe in it."""
    engine = Engine(Decoder(CFG, rngs=nnx.Rngs(0)), adamw(1e-3), cfg)
    assert engine.update_route == "fused"
    traffic = _Traffic()
    engine.observe(traffic)
    engine.step(make_batches(1, vocab=CFG.vocab_size)).resolve()
    return engine, traffic


def _differences(mode: precision.Precision, cfg: EngineConfig, engine: Engine, traffic: _Traffic) -> list[str]:
    """Where the record ``mode`` says otherwise than the engine's arrays (empty: it tells the truth)."""
    out = []

    def check(what, claimed, found):
        if claimed != found:
            out.append(f"{part.name} {what}: the record says {claimed}, the engine has {found}")

    roles = mode.bytes_per_param()  # gradients home in the mode's default dtype, as CASES set them
    for part in engine.state.ids():
        held = engine.state[part]
        leaves = jax.tree.leaves(held.params)
        n = sum(math.prod(x.shape) for x in leaves)
        # masters: the record's dtype and bytes; pageable (only the kernel touches them) where a copy streams
        check("master dtypes", {mode.masters}, {str(x.dtype) for x in leaves})
        check("master bytes", roles["masters"] * n, _nbytes(held.params))
        check("pageable masters", [mode.stream_copy] * len(leaves), [isinstance(x, np.ndarray) for x in leaves])
        # moments: m and v together, leaf by leaf (8-bit matrices where the record says so)
        check("moment bytes", sum(mode.moments_of(x.shape) for x in leaves),
              _nbytes(held.opt.mu) + _nbytes(held.opt.nu))
        mu = jax.tree.leaves(held.opt.mu, is_leaf=lambda x: isinstance(x, QuantizedMoment))
        check("quantized moments", mode.quantized, any(isinstance(m, QuantizedMoment) for m in mu))
        check("whole moments' dtype", {mode.moments}, {str(m.dtype) for m in mu if not isinstance(m, QuantizedMoment)})
        # the stream copy: 16-bit, or none (the masters cross PCIe themselves)
        check("stream copy", mode.stream_copy, held.stream is not None)
        check("stream copy bytes", roles["stream_copy"] * n, _nbytes(held.stream))
        # what crosses PCIe: to the GPU, and home
        sent = jax.tree.leaves(traffic.to_gpu[part])
        check("dtype to the GPU", {mode.to_gpu_dtype(cfg.stream_dtype, CFG.dtype)}, {str(x.dtype) for x in sent})
        check("bytes to the GPU", mode.to_gpu_bytes * n, _nbytes(sent))
        home = jax.tree.leaves(traffic.home[part])
        check("gradient dtype home", {mode.host_grad_dtypes[0]}, {str(x.dtype) for x in home})
        check("gradient bytes home", roles["host_grads"] * n, _nbytes(home))
        # the memory plan counts the same bytes
        check("the plan's moment bytes", moment_bytes(CFG, cfg, part), _nbytes(held.opt.mu) + _nbytes(held.opt.nu))
        check("the plan's gradient bytes", host_grad_bytes(cfg) * n, _nbytes(home))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_record_is_what_the_engine_allocates(name):
    cfg, mode = CASES[name], precision.MODES[name]
    assert precision.mode_of(cfg, CFG.dtype) is mode and cfg.precision is mode
    engine, traffic = _run(cfg)
    assert engine.policy.opt.precision is mode
    assert _differences(mode, cfg, engine, traffic) == []
    engine.close()


@pytest.mark.parametrize("lie", [dict(moments="float32"), dict(stream_copy=True), dict(moment_dtype="q8"),
                                 dict(masters="float32"), dict(host_grad_dtypes=("bfloat16",))])
def test_a_record_that_lies_is_caught(lie):
    """The comparison can fail: capacity mode's record with one field changed does not match its engine."""
    cfg = CASES["capacity"]
    engine, traffic = _run(cfg)
    liar = dataclasses.replace(precision.CAPACITY, **lie)
    assert _differences(liar, cfg, engine, traffic) != []
    engine.close()


def test_the_bundles_switch_to_their_mode():
    """``in_mode`` (the plan's switch) lands in the record's own mode, from every other."""
    for start in CASES.values():
        for mode in precision.MODES.values():
            assert precision.mode_of(precision.in_mode(start, mode), CFG.dtype) is mode


def test_checkpoints_resume_within_a_master_dtype():
    m = precision.MODES
    assert m["full"].resumes(m["lean"]) and m["capacity"].resumes(m["q8"]) and m["q8"].resumes(m["capacity"])
    assert not m["capacity"].resumes(m["full"])
