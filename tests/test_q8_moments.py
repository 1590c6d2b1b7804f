"""8-bit Adam moments (``EngineConfig.moment_dtype="q8"``, capacity mode) and bfloat16 gradients in host memory
(``host_grad_dtype="bfloat16"``): a part's update equals the kernel's numpy reference bit for bit, on one
device and spread over two; the engine equals a whole-model reference that applies that update to
``jax.grad``'s gradients, rounded to bfloat16 and clipped by their own norm; the mode trains as capacity mode
does on a small problem. The same for 7-bit m with 5-bit v (``moment_dtype="m7v5"``) where marked. (The kernels
themselves: tests/test_host_kernel_q8.py, test_m7v5_moments.py; checkpoints: test_checkpoint.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax import Decoder, Engine, EngineConfig, adamw
from megatrain_jax.contract.layered import block_params, io_params
from megatrain_jax.engine.transfer import Placement, local_value
from megatrain_jax.engine import precision
from megatrain_jax.engine.update import host_kernel, m7v5, q8
from megatrain_jax.engine.update.moment_formats import FORMATS
from megatrain_jax.engine.update.host_optimizer import HostOptimizer, QuantizedMoment, rounding_seed
from megatrain_jax.optim import fused_spec
from megatrain_jax.reference import model_loss

from test_capacity import _bf16_ulp, one_against_two_devices
from test_engine import TINY3, make_batches

pytestmark = pytest.mark.usefixtures("lib")  # the kernel must build: conftest.lib fails where it cannot

Q8 = EngineConfig(master_dtype="bfloat16", moment_dtype="q8", host_grad_dtype="bfloat16")
# each quantized format these tests hold to its numpy reference: its kernel's reference
REFERENCES = {"q8": q8.adamw_q8_reference, "m7v5": m7v5.adamw_m7v5_reference}
TX = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)  # noqa: E731


def _bits(x) -> np.ndarray:
    return np.array(jax.device_get(x), copy=True).view(np.uint16)  # a copy: the kernel writes in place


def _reference_update(p, m, v, g, *, t: int, salt: int, leaf: int, decay: bool, scale: float, fmt: str = "q8"):
    """One leaf's update as the engine's kernel does it: quantized moments of format ``fmt`` (``(codes, absmax)``
    pairs) for a matrix, bfloat16 ones otherwise. p, and bfloat16 moments, as uint16 bits; g float32 or
    bfloat16."""
    spec = fused_spec(TX())
    bc1, bc2 = spec.bias_corrections(float(t))
    hyper = dict(lr=float(spec.lr_at(t - 1)), b1=spec.b1, b2=spec.b2, eps=spec.eps,
                 wd=spec.weight_decay if decay else 0.0, grad_scale=scale, bc1=bc1, bc2=bc2,
                 seed=rounding_seed(t, salt, leaf), offset=0)
    if isinstance(m, tuple):
        p, mc, vc, ma, va = REFERENCES[fmt](p, m[0], v[0], m[1], v[1], g, block=FORMATS[fmt].block, **hyper)
        return np.asarray(p).view(np.uint16), (mc, ma), (vc, va)
    p, m, v = host_kernel.adamw_sr_reference(p, m, v, jnp.asarray(g, jnp.float32), **hyper)
    return _bits(p), _bits(m), _bits(v)


def _state_of(part) -> tuple[list, list, list]:
    """A part's masters (uint16 bits) and moments (``(codes, absmax)`` or uint16 bits), leaf by leaf."""
    structure = jax.tree.structure(part.params)
    moment = lambda x: (np.array(x.codes), np.array(x.absmax)) if isinstance(x, QuantizedMoment) else _bits(x)  # noqa: E731
    return ([_bits(x) for x in jax.tree.leaves(part.params)],
            [moment(x) for x in structure.flatten_up_to(part.opt.mu)],
            [moment(x) for x in structure.flatten_up_to(part.opt.nu)])


def _assert_same(a, b) -> None:
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and np.array_equal(x, y)
    else:
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", ["q8", "m7v5"])
@pytest.mark.parametrize("grad_dtype", [np.float32, jnp.bfloat16])
def test_part_update_is_the_reference_bit_for_bit(grad_dtype, fmt):
    """Every leaf of a block, over two steps: matrices through the quantized kernel, vectors through capacity
    mode's; float32 and bfloat16 gradients."""
    placement = Placement(jax.devices()[:1])
    opt = HostOptimizer(TX(), placement, jnp.bfloat16, precision=precision.MODES[fmt])
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), block_params(Decoder(TINY3, rngs=nnx.Rngs(0)))[1])
    part = opt.home(jax.jit(opt.fresh)(params))
    kinds = [isinstance(m, QuantizedMoment) for m in jax.tree.structure(params).flatten_up_to(part.opt.mu)]
    assert any(kinds) and not all(kinds)  # the matrices are 8-bit, the norm weights are not
    assert all(FORMATS[fmt].leaf(x.shape) == k for x, k in zip(jax.tree.leaves(params), kinds))
    rng = np.random.default_rng(0)
    decays = jax.tree.leaves(fused_spec(TX()).decays(params))
    for t in (1, 2):
        grads = jax.tree.map(lambda x: (rng.normal(size=x.shape) * 1e-2).astype(grad_dtype), params)
        ps, ms, vs = _state_of(part)
        part = opt.update(part, placement.to_host(grads), jnp.float32(0.5), salt=2)
        got = _state_of(part)
        for leaf, g in enumerate(jax.tree.leaves(grads)):
            want = _reference_update(ps[leaf], ms[leaf], vs[leaf], np.asarray(g), t=t, salt=2, leaf=leaf,
                                     decay=decays[leaf], scale=0.5, fmt=fmt)
            for w, x in zip(want, (got[0][leaf], got[1][leaf], got[2][leaf])):
                _assert_same(w, x)
    assert any(m[0].any() for m in _state_of(part)[1] if isinstance(m, tuple))  # codes were written


@pytest.mark.parametrize("fmt", ["q8", "m7v5"])
def test_a_part_spread_over_two_devices_updates_as_on_one_bit_for_bit(fmt):
    """Each device's rows of a matrix, with their rows of codes and scales (m7v5: v's rows 5/7 of m's bytes), get
    what one update of the whole writes."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), io_params(Decoder(TINY3, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(1)
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32) * 1e-3, params)
    out = []
    for devices in (jax.devices()[:1], jax.devices()[:2]):
        placement = Placement(devices)
        opt = HostOptimizer(TX(), placement, jnp.bfloat16, precision=precision.MODES[fmt])
        part = opt.home(placement.jit_into(opt.fresh)(params))
        assert len(placement.pieces(jax.tree.leaves(part.params)[0])) == len(devices)  # rows spread
        for _ in range(2):
            part = opt.update(part, placement.to_host(grads), jnp.float32(1.0), salt=0)
        out.append([np.array(jax.device_get(x)) for x in jax.tree.leaves((part.params, part.opt))])
    for a, b in zip(*out):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _reference_run(cfg, batches, clip, fmt: str = "q8"):
    """Whole-model training as the mode does it: ``jax.grad`` at the bfloat16 masters, each part's gradient
    rounded to bfloat16 (what is sent home), the global norm of the rounded gradients and its clip factor,
    then each leaf through ``_reference_update`` with the engine's seeds (salt = the part's index)."""
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model, nnx.Param)
    spec = fused_spec(TX())
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: model_loss(nnx.merge(graphdef, p), b)))
    split = lambda m: [io_params(m)] + block_params(m)  # noqa: E731  (the engine's parts: io, then blocks)
    structures = [jax.tree.structure(p) for p in split(model)]
    masters = [[_bits(jnp.asarray(x).astype(jnp.bfloat16)) for x in jax.tree.leaves(p)] for p in split(model)]

    def zeros(x, kind):
        if FORMATS[fmt].leaf(x.shape):
            return (np.zeros(FORMATS[fmt].codes_shape(x.shape, kind), np.uint8),
                    np.zeros(FORMATS[fmt].scale_shape(x.shape), np.float32))
        return np.zeros(x.shape, np.uint16)

    moments = [[(zeros(x, "m"), zeros(x, "v")) for x in jax.tree.leaves(p)] for p in split(model)]
    decays = [jax.tree.leaves(spec.decays(p)) for p in split(model)]
    as_f32 = lambda bits: jnp.asarray(bits.view(jnp.bfloat16)).astype(jnp.float32)  # noqa: E731
    losses = []
    for t, batch in enumerate(batches, start=1):
        nnx.update(model.io, jax.tree.unflatten(structures[0], [as_f32(x) for x in masters[0]]))
        for block, st, part in zip(model.blocks, structures[1:], masters[1:]):
            nnx.update(block, jax.tree.unflatten(st, [as_f32(x) for x in part]))
        loss, grads = grad_fn(nnx.state(model, nnx.Param), batch.filled())
        losses.append(float(loss))
        grads = [[np.asarray(g.astype(jnp.bfloat16)) for g in jax.tree.leaves(p)]
                 for p in split(nnx.merge(graphdef, grads))]
        norm = float(np.sqrt(sum(np.sum(np.square(g.astype(np.float32))) for part in grads for g in part)))
        scale = min(1.0, clip / norm)
        for index in range(len(masters)):
            for leaf, (g, decay) in enumerate(zip(grads[index], decays[index])):
                (m, v), p = moments[index][leaf], masters[index][leaf]
                p, m, v = _reference_update(p, m, v, g, t=t, salt=index, leaf=leaf, decay=decay, scale=scale,
                                            fmt=fmt)
                masters[index][leaf], moments[index][leaf] = p, (m, v)
    return losses, masters


@functools.cache
def _clipped_reference(fmt: str = "q8"):
    """``_reference_run`` of TINY3 on ``make_batches(3)`` with clip 0.05, once per process and format: the test
    below compares both micro-batch counts with this one (deterministic) run."""
    return _reference_run(TINY3, make_batches(3, vocab=TINY3.vocab_size), clip=0.05, fmt=fmt)


@pytest.mark.parametrize("fmt", ["q8", "m7v5"])
@pytest.mark.parametrize("micro", [1, 2])
def test_engine_equals_the_whole_model_reference(micro, fmt):
    """Three steps with clipping: the same losses, and masters that mostly equal the reference's bit for bit
    (as in capacity mode, the gradients differ in float32 summation order, and Adam turns an element whose
    gradient is rounding noise into an update of random sign)."""
    batches = make_batches(3, vocab=TINY3.vocab_size)
    ref_losses, ref_parts = _clipped_reference(fmt)  # _reference_run(TINY3, batches, clip=0.05, fmt=fmt)
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), EngineConfig(
        master_dtype="bfloat16", moment_dtype=fmt, host_grad_dtype="bfloat16", clip_norm=0.05, micro_batches=micro))
    for s, batch in enumerate(batches):
        e = engine.step([batch]).resolve()
        assert abs(e["loss"] - ref_losses[s]) <= 1e-5 * ref_losses[s], (s, e, ref_losses)
    engine.sync()
    same = close = total = 0
    for part, want in zip(engine.state.parts, ref_parts):
        for x, w in zip(jax.tree.leaves(part.params), want):
            x = np.asarray(local_value(x)).astype(np.float32)
            w = np.asarray(w.view(jnp.bfloat16)).astype(np.float32)
            same += int(np.sum(x == w))
            close += int(np.sum(np.abs(x - w) <= _bf16_ulp(w) * 1.01))
            total += x.size
    assert same / total > 0.85 and close / total > 0.95, (same / total, close / total)


def test_the_gradient_norm_is_the_rounded_gradients():
    """The step's reported norm is the norm of what was sent home: the bfloat16 gradients."""
    batches = make_batches(1, vocab=TINY3.vocab_size)
    engine = Engine(Decoder(TINY3, rngs=nnx.Rngs(0)), TX(), Q8)
    norm = engine.step(batches).resolve()["grad_norm"]
    model = Decoder(TINY3, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)  # the bf16 masters
    grads = jax.grad(lambda p: model_loss(nnx.merge(graphdef, p), batches[0].filled()))(params)
    rounded = np.sqrt(sum(float(jnp.sum(jnp.square(g.astype(jnp.bfloat16).astype(jnp.float32))))
                          for g in jax.tree.leaves(grads)))
    exact = np.sqrt(sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(grads)))
    assert abs(norm - rounded) <= 1e-5 * rounded
    assert rounded != exact  # the test can tell them apart


def test_trains_as_capacity_mode_does():
    """On one batch over several steps, the 8-bit run's losses follow capacity mode's within 1%."""
    cfg = TINY3.replace(dtype="bfloat16")
    batches = make_batches(1, vocab=cfg.vocab_size) * 8
    runs = {}
    for name, ec in (("capacity", EngineConfig(master_dtype="bfloat16")), ("q8", Q8)):
        engine = Engine(Decoder(cfg, rngs=nnx.Rngs(0)), TX(), ec)
        runs[name] = [engine.step([b]).resolve()["loss"] for b in batches]
    assert runs["q8"][-1] < runs["q8"][0] - 0.05
    assert max(abs(a - b) / b for a, b in zip(runs["q8"], runs["capacity"])) < 0.01, runs


@pytest.mark.parametrize("change,message", [
    (dict(moment_dtype="q8"), "part of capacity mode"),
    (dict(master_dtype="bfloat16", moment_dtype="int8"), "moment_dtype must be unset"),
    (dict(master_dtype="bfloat16", host_grad_dtype="float16"), "host_grad_dtype must be"),
    (dict(master_dtype="bfloat16", moment_dtype="q8", disk_parts=1, disk_dir="/tmp/x"), "not quantized ones"),
    (dict(master_dtype="bfloat16", moment_dtype="m7v5", disk_parts=1, disk_dir="/tmp/x"), "moment_dtype='m7v5'"),
])
def test_the_mode_refuses_what_it_cannot_do(change, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**change)


def test_two_devices_train_as_one():
    """The whole engine over two devices (gradients rounded to bfloat16 per shard, 8-bit moments updated row
    range by row range): nearly every master equals the one-device run's (the two-device gradients differ in
    the last float32 bits, which Adam amplifies where a gradient is rounding noise)."""
    exact, close = one_against_two_devices(Q8, TX)
    assert exact > 0.85 and close > 0.95, (exact, close)
