"""Kept residuals (megatrain_jax.contract.remat): what a model marks with ``keep_residuals`` goes from the engine's
forward program to its backward program instead of being recomputed, and training is unchanged.

On a CPU there is no cuDNN: these tests run the Decoder's flash-attention branch with XLA's attention
standing in for cuDNN's (its residuals are T x T there, which a real run would never keep, but the
mechanism is the same). tests/test_attention.py checks the real kernel on a Hopper GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import megatrain_jax.engine.device_fns as device_fns_module
import megatrain_jax.models.layers as layers
from megatrain_jax import Decoder, EngineConfig, preset
from megatrain_jax.engine.device_fns import device_fns
from megatrain_jax.contract.layered import block_params, layered
from megatrain_jax.plan.activations import kept_bytes
from megatrain_jax.contract.remat import KEEP_POLICY, SplitVJP, keep_residuals
from megatrain_jax.engine.transfer import Placement
from megatrain_jax.engine.parts import IO, PartId
from test_engine import ADAMW, FUSED, TINY3, _trained, run_both
from test_mesh import reference, train

XLA_ATTENTION = jax.nn.dot_product_attention


def _masked(q, k, v, segment_ids, max_segments, window, scale=None):
    mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return XLA_ATTENTION(q, k, v, mask=mask, is_causal=True, implementation="xla", scale=scale,
                         local_window_size=None if window is None else (window - 1, 0))


@pytest.fixture
def cudnn_stand_in(monkeypatch):
    """The Decoder takes its cuDNN branch (marking attention's residuals), with XLA computing it."""
    monkeypatch.setattr(layers, "attention_implementation", lambda cfg, dtype, packed=False: "cudnn")
    monkeypatch.setattr(layers, "packed_attention", _masked)
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation=None, **kw: XLA_ATTENTION(*a, implementation="xla", **kw))
    monkeypatch.setattr(device_fns_module, "_CACHE", {})  # no programs traced without the stand-in


def _attention(q, k, v, segment_ids):
    s = jnp.einsum("btnh,bsnh->bnts", q, k)
    T = q.shape[1]
    allowed = jnp.tril(jnp.ones((T, T), bool))[None, None] & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(jnp.where(allowed, s, -1e9), -1), v)


def test_keep_residuals_changes_neither_value_nor_gradient():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, dy = (jax.random.normal(key, (2, 6, 2, 4)) for key in keys)
    seg = jnp.array([[0, 0, 1, 1, 1, 1], [0] * 6])  # an integer argument: its cotangent is float0
    out, pull = jax.vjp(_attention, q, k, v, seg)
    kept_out, kept_pull = jax.vjp(keep_residuals(_attention), q, k, v, seg)
    np.testing.assert_array_equal(out, kept_out)
    for a, b in zip(pull(dy)[:3], kept_pull(dy)[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_split_vjp_joins_in_another_program_without_recomputing_what_was_kept():
    """The forward program returns only the marked residuals (not its inputs); the backward program, given
    the inputs again, computes the same gradients as a plain VJP, with no softmax of its own."""
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    w = {"q": jax.random.normal(keys[0], (8, 8)) * 0.3, "o": jax.random.normal(keys[1], (8, 8)) * 0.3}
    x, dy = jax.random.normal(keys[2], (2, 6, 8)), jax.random.normal(keys[3], (2, 6, 8))
    seg = jnp.array([[0, 0, 1, 1, 1, 1], [0] * 6])

    def block(w, x, seg, attention):
        q = (x @ w["q"]).reshape(2, 6, 2, 4)
        return x + attention(q, q, q, seg).reshape(x.shape) @ w["o"]

    split = SplitVJP()

    @jax.jit
    def forward(w, x, seg):
        y, pullback = jax.vjp(jax.checkpoint(lambda w, x: block(w, x, seg, keep_residuals(_attention)),
                                             policy=KEEP_POLICY), w, x)
        return y, split.split("block", pullback, (w, x, seg))

    @jax.jit
    def backward(w, x, seg, kept, dy):
        return split.join("block", kept, (w, x, seg))(dy)

    y, kept = forward(w, x, seg)
    assert not any(k.shape in (x.shape, (8, 8)) for k in kept)  # neither the input nor the weights
    assert any(k.shape == (2, 2, 6, 6) for k in kept)  # the softmax probabilities (XLA's residual)
    grads = backward(w, x, seg, kept, dy)
    ref_y, ref_pull = jax.vjp(lambda w, x: block(w, x, seg, _attention), w, x)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)  # (another program: a GPU fuses it otherwise)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_pull(dy))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the compiled backward has no softmax left (the lowered text may hold dead code that XLA removes)
    assert "exponential" not in backward.lower(w, x, seg, kept, dy).compile().as_text()
    recompute = jax.jit(lambda w, x, dy: jax.vjp(lambda w, x: block(w, x, seg, _attention), w, x)[1](dy))
    assert "exponential" in recompute.lower(w, x, dy).compile().as_text()
    forward(w, x * 2, seg), backward(w, x * 2, seg, kept, dy)
    assert forward._cache_size() == backward._cache_size() == 1


def test_a_residual_that_is_the_output_is_kept_once():
    """exp's backward needs its own output (as cuDNN's needs its output): one kept value, not two."""
    x = jnp.linspace(-1.0, 1.0, 8)
    split = SplitVJP()

    @jax.jit
    def forward(x):
        y, pullback = jax.vjp(jax.checkpoint(lambda x: keep_residuals(jnp.exp)(x) * 2, policy=KEEP_POLICY), x)
        return y, split.split("exp", pullback, (x,))

    y, kept = forward(x)
    assert len(kept) == 1 and kept[0].shape == (8,)
    np.testing.assert_allclose(kept[0], jnp.exp(x), rtol=1e-6)
    grad = jax.jit(lambda x, kept: split.join("exp", kept, (x,))(jnp.ones(8)))(x, kept)[0]
    np.testing.assert_allclose(grad, 2 * jnp.exp(x), rtol=1e-6)


def test_a_backward_before_its_forward_or_with_other_residuals_is_refused():
    with pytest.raises(RuntimeError, match="must follow the forward"):
        SplitVJP().join("block", (), ())
    split, x = SplitVJP(), jnp.ones(4)
    jax.jit(lambda x: split.split("exp", jax.vjp(keep_residuals(jnp.exp), x)[1], (x,)))(x)
    with pytest.raises(RuntimeError, match="do not match"):
        jax.jit(lambda x: split.join("exp", (x, x), (x,)))(x)
    with pytest.raises(RuntimeError, match="changed between traces"):  # another closure under the same key
        jax.jit(lambda x: split.split("exp", jax.vjp(keep_residuals(lambda x: jnp.exp(x) * jnp.sin(x)), x)[1],
                                      (x,)))(x)


def test_decoder_marks_attention_residuals_on_its_flash_branch(cudnn_stand_in, monkeypatch):
    cfg = preset("tiny", layers=2)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    fns = device_fns(layered(model), Placement(None))
    x = jnp.ones((2, 16, cfg.hidden), jnp.float32)
    pos = jnp.arange(16)[None].repeat(2, 0)
    (y, kept), _ = fns.forward(block_params(model)[0], x, pos, None, keep=True)
    shapes = [k.shape for k in kept]
    assert (2, 16, cfg.heads, cfg.dim_per_head) in shapes  # the attention output (the o-projection's input)
    # nothing the backward is given anyway, nor q/k/v (recomputed from the input), nor RoPE's constants
    params = {p.shape for p in jax.tree.leaves(block_params(model)[0])}
    assert not any(s == x.shape or s in params or s == (cfg.dim_per_head // 2,) for s in shapes), shapes
    # on XLA's own branch nothing at all is kept
    monkeypatch.setattr(layers, "attention_implementation", lambda cfg, dtype, packed=False: "xla")
    monkeypatch.setattr(device_fns_module, "_CACHE", {})
    fns = device_fns(layered(model), Placement(None))
    (_, kept), _ = fns.forward(block_params(model)[0], x, pos, None, keep=True)
    assert kept == ()
    # XLA's probabilities [..., T, T] (per kv head and group): what cuDNN keeps instead is [B, N, T, 1]
    assert any(s[-2:] == (16, 16) for s in shapes), shapes


@pytest.mark.parametrize("packed", [False, True])
def test_the_decoders_gradients_are_the_same_with_and_without_the_wrapper(cudnn_stand_in, monkeypatch, packed):
    """The reference trainer of the engine tests goes through ``keep_residuals`` too (the Decoder marks its
    cuDNN branch): the wrapper itself must not change the model's gradients, bit for bit."""
    from megatrain_jax.reference import model_loss
    from test_engine import make_batches
    model = Decoder(preset("tiny", layers=2), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch = make_batches(1, packed=packed)[0].filled()
    grad = lambda: jax.jit(jax.grad(lambda p: model_loss(nnx.merge(graphdef, p), batch)))(params)  # noqa: E731
    wrapped = grad()
    monkeypatch.setattr(layers, "keep_residuals", lambda fn: fn)
    plain = grad()
    leaves = jax.tree.leaves(wrapped)
    assert leaves and any(np.any(np.asarray(g) != 0) for g in leaves)
    jax.tree.map(np.testing.assert_array_equal, wrapped, plain)


@pytest.mark.parametrize("engine_cfg,batch_kw", [
    (EngineConfig(micro_batches=2, keep_residuals=True), {}),
    (EngineConfig(micro_batches=2, keep_residuals=True), {"packed": True}),
    (EngineConfig(micro_batches=2, keep_residuals=True, offload_activations=2, clip_norm=0.05), {"packed": True}),
    (EngineConfig(accumulate_steps=2, prefetch_depth=2, keep_residuals=True), {"mask": True}),
    (EngineConfig(micro_batches=2), {}),
], ids=["plain", "packed", "offloaded", "accumulate-depth2", "not-kept"])
def test_engine_with_kept_residuals_equals_reference(cudnn_stand_in, engine_cfg, batch_kw):
    engine = run_both(TINY3, ADAMW, engine_cfg, batch_kw=batch_kw, shared="cudnn_stand_in")
    programs = {name for name, *_ in engine.fns._programs}  # which programs ran
    assert ("forward_keep" in programs) == engine_cfg.keep_residuals != ("forward" in programs), programs
    sizes = engine.fns.cache_sizes()
    # compiled once (the backward once without an accumulator and, with several micro-batches, once with)
    assert sizes["forward"] == 1 and sizes["backward"] == min(engine_cfg.micro_batches, 2), sizes


@pytest.mark.parametrize("engine_cfg,batch_kw", [
    (EngineConfig(micro_batches=2, kept_layers=2), {}),
    (EngineConfig(micro_batches=2, kept_layers=3, keep_residuals=True), {"packed": True}),
    (EngineConfig(accumulate_steps=2, prefetch_depth=2, kept_layers=1, clip_norm=0.05), {"mask": True}),
    (EngineConfig(micro_batches=2, kept_layers=1, offload_activations=2, keep_residuals=True), {"packed": True}),
], ids=["last-two", "all-packed", "accumulate-depth2", "beside-offload"])
def test_engine_with_kept_matrix_products_equals_reference(cudnn_stand_in, engine_cfg, batch_kw):
    """``kept_layers``: the last blocks' backward is given every matrix product of their forward (no
    recompute of them); the step is the reference step all the same."""
    engine = run_both(TINY3, ADAMW, engine_cfg, batch_kw=batch_kw, shared="cudnn_stand_in")
    programs = {name for name, *_ in engine.fns._programs}
    assert {"forward_products", "backward_products"} <= programs, programs
    # the first blocks (where there are any) run as configured: recomputed, or keeping the marked residuals only
    others = {"forward_keep" if engine_cfg.keep_residuals else "forward"} if engine_cfg.kept_layers < TINY3.layers \
        else set()
    assert programs & {"forward", "forward_keep"} == others, programs


def test_the_13b_layout_in_miniature_equals_reference(cudnn_stand_in):
    """The layout the plan picked for 13B at 32K tokens on one H200 (``side_by_side.py --only 13b``,
    h200x2_side_by_side_13b_d827385.json): the embeddings and the first blocks resident, the last blocks keeping
    their matrix products and marked residuals, the fused host AdamW with every host update split, prefetch depth
    2, one micro-batch. In float32 it is the reference step; with a bfloat16 stream the gradients sent home in
    bfloat16 (as there) train bit for bit as float32 ones."""
    layout = dict(prefetch_depth=2, clip_norm=0.05, resident_layers=1, resident_io=True, kept_layers=2,
                  keep_residuals=True, split_parts=3)
    engine = run_both(TINY3, FUSED, EngineConfig(**layout), shared="cudnn_stand_in")
    assert engine.resident_parts == [IO, PartId.block(0)]
    assert engine.update_route == "fused"
    programs = {name for name, *_ in engine.fns._programs}
    assert {"forward_products", "backward_products"} <= programs and "forward" not in programs, programs
    full = _trained(EngineConfig(**layout))
    half = _trained(EngineConfig(**layout, host_grad_dtype="bfloat16"))
    assert half.policy.opt.splits and half.policy.split == {PartId.block(1), PartId.block(2)}
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(half.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kept_matrix_products_are_the_projections_outputs():
    """What ``forward(..., products=True)`` keeps on XLA's attention: one tensor per projection the backward
    needs (q, k, v, the o-projection's output, gate and up; not the down projection's, which only feeds the
    residual sum), as ``plan.activations.products_bytes`` counts them; nothing of attention's own."""
    from megatrain_jax.plan.activations import products_bytes
    cfg = preset("tiny", layers=2)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    fns = device_fns(layered(model), Placement(None))
    x = jnp.ones((2, 16, cfg.hidden), jnp.float32)
    pos = jnp.arange(16)[None].repeat(2, 0)
    (y, kept), _ = fns.forward(block_params(model)[0], x, pos, None, keep=True, products=True)
    q, kv = cfg.heads * cfg.dim_per_head, cfg.kv_heads * cfg.dim_per_head
    assert sorted(k.shape[-1] for k in kept) == sorted([q, kv, kv, cfg.hidden, cfg.ffn, cfg.ffn])
    assert sum(k.nbytes for k in kept) == products_bytes(cfg, 2, 16)
    (dx, _), _ = fns.backward(block_params(model)[0], x, pos, None, jnp.ones_like(y), None, kept=kept, products=True)
    (dx_plain, _), _ = fns.backward(block_params(model)[0], x, pos, None, jnp.ones_like(y), None)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_plain), rtol=1e-6, atol=1e-6)


def test_kept_layers_that_meet_the_offloaded_blocks_or_exceed_the_model_are_refused():
    with pytest.raises(ValueError, match="integer >= 0"):
        EngineConfig(kept_layers=-1)
    with pytest.raises(ValueError, match="integer >= 0"):
        EngineConfig(kept_layers=True)
    with pytest.raises(ValueError, match="more than the model's 3 blocks"):
        EngineConfig(kept_layers=4).check_layers(3)
    with pytest.raises(ValueError, match="kept_layers <= 1"):
        EngineConfig(kept_layers=2, offload_activations=2, prefetch_depth=1).check_layers(3)
    EngineConfig(kept_layers=1, offload_activations=2, prefetch_depth=1).check_layers(3)
    # the last prefetch_depth blocks' inputs stay on the GPU
    EngineConfig(kept_layers=1, offload_activations=3, prefetch_depth=1).check_layers(3)
    EngineConfig(kept_layers=2, offload_activations=3).check_layers(3)  # two ahead: only block 0's are offloaded


def test_kept_residuals_over_two_devices_equal_one_device_and_reference(cudnn_stand_in):
    cfg, engine_cfg = preset("tiny", layers=3), EngineConfig(micro_batches=2, keep_residuals=True, kept_layers=1)
    _, one_model, one_outs = train(1, cfg, engine_cfg, steps=3, batch_kw={"packed": True})
    _, two_model, two_outs = train(2, cfg, engine_cfg, steps=3, batch_kw={"packed": True})
    ref_model, ref_outs = reference(cfg, engine_cfg, steps=3, batch_kw={"packed": True})
    for a, b, r in zip(one_outs, two_outs, ref_outs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(r["loss"] - b["loss"]) <= 1e-5 * abs(r["loss"])
    from test_engine import assert_models_close
    assert_models_close(one_model, two_model)
    assert_models_close(ref_model, two_model)


on_hopper = pytest.mark.skipif(layers.gpu_compute_capability() != (9, 0),
                               reason="cuDNN's flash attention with its packed layout needs a Hopper GPU")


@on_hopper
@pytest.mark.parametrize("packed", [False, True])
def test_kept_cudnn_residuals_give_the_same_gradients_without_a_second_attention_forward_on_gpu(packed):
    """On cuDNN: the forward keeps attention's output and softmax statistics (B x T x N x (2H + 4) bytes,
    the statistics once per possible document in the packed layout, as the plan counts), and the backward program, given them, computes the same gradients as the recomputing one with
    no cuDNN forward call of its own."""
    cfg = preset("tiny", layers=2, hidden=512, heads=4, kv_heads=2, ffn=1024, dtype="bfloat16", max_positions=4096)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    fns = device_fns(layered(model), Placement(None))
    B, T = 2, 2048
    ks = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(ks[0], (B, T, cfg.hidden), jnp.bfloat16)
    dy = jax.random.normal(ks[1], (B, T, cfg.hidden), jnp.bfloat16)
    pos = jnp.arange(T)[None].repeat(B, 0)
    seg = jnp.asarray(np.repeat(np.arange(4), T // 4)[None].repeat(B, 0)) if packed else None
    params = block_params(model)[0]
    (y, kept), _ = fns.forward(params, x, pos, seg, keep=True)
    (dx, g), _ = fns.backward(params, x, pos, seg, dy, None, kept=kept)
    (dx_ref, g_ref), _ = fns.backward(params, x, pos, seg, dy, None)
    for a, b in zip(jax.tree.leaves((dx, g)), jax.tree.leaves((dx_ref, g_ref))):
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b)))
        assert err < 1e-2, err
    # cuDNN's packed layout keeps a row of statistics per possible document (segments_per_row)
    expected = kept_bytes(cfg, EngineConfig(keep_residuals=True), B, T, True, packed)
    assert expected == B * T * cfg.heads * (cfg.dim_per_head * 2 + 4 * (cfg.segments_per_row(T) if packed else 1))
    nbytes = sum(k.nbytes for k in kept)
    assert expected <= nbytes <= 1.1 * expected + 4096, (nbytes, expected, [(k.shape, k.dtype) for k in kept])
    hlo = fns.compiled("backward_kept", params, x, pos, seg, kept, dy, None).as_text()  # the backward's kernels
    calls = [line for line in hlo.splitlines() if "custom_call_target=\"__cudnn$fmha" in line]
    assert calls and all("Backward" in line for line in calls), calls


@pytest.mark.parametrize("name,overrides", [
    ("llama3.2-1b", {}), ("qwen3-8b", {}), ("qwen2.5-14b", {}), ("olmo2-1b", {}), ("gemma3-1b", {}),
    ("phi3-mini", {}), ("gpt-oss-20b", {}), ("mixtral-8x7b", {}), ("qwen2-57b-a14b", {}),
    ("deepseek-v3", {"first_k_dense_replace": 1}),
])
def test_the_plans_matrix_products_are_what_each_familys_block_keeps(name, overrides):
    """``products_bytes`` against the traced forward of every kind of block (abstract: no weights), on XLA's
    attention (which marks nothing): exact, but for a router's logits, which the plan counts as float32."""
    from megatrain_jax.plan.activations import products_bytes
    cfg = preset(name, layers=2, attention_impl="xla", **overrides)  # on a GPU too ("auto" would take cuDNN's)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    lm = layered(model)
    fns = device_fns(lm, Placement(None))
    B, T = 2, 8
    x = jax.ShapeDtypeStruct((B, T, cfg.hidden), jnp.dtype(cfg.dtype))
    pos = jax.ShapeDtypeStruct((B, T), jnp.int32)
    for i in range(cfg.layers):
        kind = lm.block_kinds[i]
        _, kept = jax.eval_shape(lambda p, x, pos: fns._forward_keep(p, x, pos, None, kind=kind, products=True),
                                 block_params(model)[i], x, pos)
        traced = sum(k.size * k.dtype.itemsize for k in kept)
        rule = products_bytes(cfg, B, T, layer=i)
        slack = B * T * cfg.moe.experts * 2 if cfg.is_moe_layer(i) else 0  # bfloat16 router logits
        assert traced <= rule <= traced + slack, (i, [(k.shape, str(k.dtype)) for k in kept], rule)
