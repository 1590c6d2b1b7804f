"""The decoder against an independent hand-written forward, its invariants, presets and config errors."""

from __future__ import annotations

import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax.models import PRESETS, Decoder, DecoderConfig, RopeScaling, preset
from megatrain_jax.models.rope import apply_rope, rope_inv_freq

HI = jax.lax.Precision.HIGHEST


def pure_params(model: nnx.Module) -> dict:
    """The model's parameters as a nested dict of arrays (block indices are int keys)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def jitted(model: nnx.Module):
    """``model(*args)`` compiled once (eager NNX dispatches op by op, slow even for tiny models), with
    full float32 matmuls so that the 1e-5 comparisons also hold where the default is TF32 (GPUs)."""
    graphdef, params = nnx.split(model, nnx.Param)
    fn = jax.jit(lambda p, *args: nnx.merge(graphdef, p)(*args))

    def call(*args):
        with jax.default_matmul_precision("highest"):
            return fn(params, *args)
    return call


# ---------------------------------------------------------------------------------------------------
# An independent reference forward, written from the parameter pytree with plain jnp (float32).
# It shares no code with megatrain_jax.models: attention is a per-head loop with an explicit softmax.
# ---------------------------------------------------------------------------------------------------

def ref_inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """RoPE inverse frequencies, with Llama 3.1 scaling written as in Meta's reference code."""
    hd = cfg.dim_per_head
    freqs = [1.0 / cfg.rope_theta ** (i / hd) for i in range(0, hd, 2)]
    s = cfg.rope_scaling
    if s is not None:
        low_wavelen, high_wavelen = s.original_max_position / s.low_freq_factor, s.original_max_position / s.high_freq_factor
        scaled = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                scaled.append(f)
            elif wavelen > low_wavelen:
                scaled.append(f / s.factor)
            else:
                smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
                scaled.append((1 - smooth) * f / s.factor + smooth * f)
        freqs = scaled
    return np.asarray(freqs, np.float32)


def ref_rmsnorm(x, scale, eps):
    return scale * (x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


@functools.partial(jax.jit, static_argnums=1)
def ref_forward(p: dict, cfg: DecoderConfig, tokens_BT, positions_BT, segment_ids_BT=None) -> jax.Array:
    """Float32 logits [B, T, V] computed directly from ``pure_params(model)``."""
    B, T = tokens_BT.shape
    hd, N, K = cfg.dim_per_head, cfg.heads, cfg.kv_heads
    mm = lambda a, b: jnp.matmul(a, b, precision=HI)

    angles = jnp.asarray(positions_BT, jnp.float32)[..., None] * ref_inv_freq(cfg)  # B T hd/2
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)

    def rope(x_BTH):  # one head
        x1, x2 = x_BTH[..., :hd // 2], x_BTH[..., hd // 2:]
        return x_BTH * cos + jnp.concatenate([-x2, x1], -1) * sin

    q_i, k_i = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    allowed = k_i <= q_i
    if cfg.sliding_window is not None:
        allowed = allowed & (q_i - k_i < cfg.sliding_window)  # a window of W keys, the query included
    allowed = jnp.broadcast_to(allowed, (B, T, T))
    if segment_ids_BT is not None:
        allowed = allowed & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])

    def proj(x, lin):
        y = mm(x, lin["kernel"])
        return y + lin["bias"] if "bias" in lin else y

    post = cfg.norm_placement == "post"  # OLMo 2: x + norm(f(x)); else x + f(norm(x))
    x = p["io"]["embedding"][tokens_BT]
    for i in range(cfg.layers):
        blk = p["blocks"][i]
        a = blk["attn"]
        h = x if post else ref_rmsnorm(x, blk["attn_norm"]["scale"], cfg.norm_eps)
        q, k = proj(h, a["q"]), proj(h, a["k"])
        if cfg.qk_norm and cfg.qk_norm_width == "all_heads":  # over the whole projection, before the heads split
            q = ref_rmsnorm(q, a["q_norm"]["scale"], cfg.norm_eps)
            k = ref_rmsnorm(k, a["k_norm"]["scale"], cfg.norm_eps)
        q, k = q.reshape(B, T, N, hd), k.reshape(B, T, K, hd)
        v = proj(h, a["v"]).reshape(B, T, K, hd)
        heads = []
        for n in range(N):
            kv = n // (N // K)  # query head n reads kv head n // group
            qn, kn, vn = q[:, :, n], k[:, :, kv], v[:, :, kv]
            if cfg.qk_norm and cfg.qk_norm_width == "head":
                qn = ref_rmsnorm(qn, a["q_norm"]["scale"], cfg.norm_eps)
                kn = ref_rmsnorm(kn, a["k_norm"]["scale"], cfg.norm_eps)
            qn, kn = rope(qn), rope(kn)
            scores = jnp.einsum("bqh,bkh->bqk", qn, kn, precision=HI) / math.sqrt(hd)
            scores = jnp.where(allowed, scores, -jnp.inf)
            e = jnp.exp(scores - scores.max(-1, keepdims=True))
            probs = e / e.sum(-1, keepdims=True)
            heads.append(jnp.einsum("bqk,bkh->bqh", probs, vn, precision=HI))
        out = mm(jnp.concatenate(heads, -1), a["o"]["kernel"])
        x = x + (ref_rmsnorm(out, blk["attn_norm"]["scale"], cfg.norm_eps) if post else out)
        h = x if post else ref_rmsnorm(x, blk["mlp_norm"]["scale"], cfg.norm_eps)
        m = blk["mlp"]
        g = mm(h, m["gate"]["kernel"])
        out = mm((g / (1 + jnp.exp(-g))) * mm(h, m["up"]["kernel"]), m["down"]["kernel"])
        x = x + (ref_rmsnorm(out, blk["mlp_norm"]["scale"], cfg.norm_eps) if post else out)
    x = ref_rmsnorm(x, p["io"]["final_norm"]["scale"], cfg.norm_eps)
    w = p["io"]["embedding"].T if cfg.tie_embeddings else p["io"]["lm_head"]
    return mm(x, w)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


FAMILY_CASES = {
    "llama-untied": dict(),
    "llama-tied": dict(tie_embeddings=True),
    "mistral-window4": dict(family="mistral", sliding_window=4),
    "qwen2-qkv-bias": dict(family="qwen2", qkv_bias=True, norm_eps=1e-6, rope_theta=1e6),
    "qwen3-qk-norm": dict(family="qwen3", qk_norm=True, head_dim=16, norm_eps=1e-6),
    "olmo2-post-norm": dict(family="olmo2", qk_norm=True, qk_norm_width="all_heads", norm_placement="post",
                            rope_theta=500000.0, norm_eps=1e-6),
    "llama3-rope-scaling": dict(rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                         original_max_position=64)),
    "llama-packed-segments": dict(),
}


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_forward_matches_independent_reference(case, make_cfg, build_model, tokens):
    """Each family switch (tied head, sliding window, qkv bias, qk norm per head or over all heads, post-norm
    blocks, llama3 RoPE scaling, packed segments) gives the same logits as a from-scratch implementation of
    the published architecture."""
    cfg = make_cfg(**FAMILY_CASES[case])
    model = build_model(cfg)
    B, T = 2, 16
    toks = tokens(B, T, cfg.vocab_size)
    # Row 1 starts at position 40: RoPE (and its scaling) must act on positions, not on indices.
    positions = np.stack([np.arange(T), np.arange(40, 40 + T)]).astype(np.int32)
    segs = np.array([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7], np.int32) if "segments" in case else None
    got = jitted(model)(jnp.asarray(toks), jnp.asarray(positions), None if segs is None else jnp.asarray(segs))
    want = ref_forward(pure_params(model), cfg, toks, positions, segs)
    assert got.shape == (B, T, cfg.vocab_size) and got.dtype == jnp.float32
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("switch", [dict(sliding_window=None), dict(rope_scaling=None)])
def test_reference_sees_the_family_switches(switch, make_cfg, build_model, tokens):
    """Guards the test above: the window and the scaling really change the logits at these sizes, so
    a model that ignored them would fail the reference comparison."""
    cfg = make_cfg(family="mistral", sliding_window=4,
                   rope_scaling=RopeScaling(factor=8.0, original_max_position=64))
    toks, pos = tokens(1, 16, cfg.vocab_size), np.arange(40, 56, dtype=np.int32)[None]
    params = pure_params(build_model(cfg))
    with_switch = ref_forward(params, cfg, toks, pos)
    without = ref_forward(params, cfg.replace(**switch), toks, pos)
    assert rel_err(without, with_switch) > 1e-3


@pytest.mark.parametrize("family", [dict(), dict(family="mistral", sliding_window=4)])
def test_causality(family, make_cfg, build_model, tokens):
    """Changing token t leaves every logit before t unchanged (and does change logits at t)."""
    cfg = make_cfg(**family)
    model = jitted(build_model(cfg))
    toks = tokens(2, 16, cfg.vocab_size)
    base = np.asarray(model(jnp.asarray(toks)))
    for t in (0, 7, 15):
        changed = toks.copy()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
        out = np.asarray(model(jnp.asarray(changed)))
        np.testing.assert_allclose(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert np.max(np.abs(out[:, t] - base[:, t])) > 1e-3


def test_gqa_equals_expanded_mha(make_cfg, build_model, tokens):
    """Grouped-query attention equals multi-head attention whose k/v weights repeat each kv head for
    its group of query heads (the head-to-group mapping is the Hugging Face one)."""
    gqa_cfg = make_cfg(family="qwen2", qkv_bias=True, heads=4, kv_heads=2)
    mha_cfg = gqa_cfg.replace(kv_heads=4)
    gqa, mha = build_model(gqa_cfg, seed=1), build_model(mha_cfg, seed=2)
    hd, group = gqa_cfg.dim_per_head, gqa_cfg.heads // gqa_cfg.kv_heads

    def expand(w):  # [..., K * hd] -> [..., N * hd], each kv head repeated group times in place
        lead = w.shape[:-1]
        return jnp.repeat(w.reshape(*lead, gqa_cfg.kv_heads, hd), group, axis=-2).reshape(*lead, -1)

    params = pure_params(gqa)
    for blk in params["blocks"].values():
        for name in ("k", "v"):
            blk["attn"][name] = {key: expand(w) for key, w in blk["attn"][name].items()}
    state = nnx.state(mha, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(mha, state)

    toks = jnp.asarray(tokens(2, 12, gqa_cfg.vocab_size))
    assert rel_err(jitted(mha)(toks), jitted(gqa)(toks)) < 1e-5


def test_rope_depends_only_on_relative_position():
    """<rope(q, m), rope(k, n)> is a function of m - n alone: the property RoPE exists for."""
    hd = 16
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, hd))
    for scaling in (None, RopeScaling(factor=8.0, original_max_position=64)):
        inv_freq = rope_inv_freq(hd, 10000.0, scaling)

        def score(m, n):
            qm = apply_rope(q, jnp.array([[m]]), inv_freq)
            kn = apply_rope(k, jnp.array([[n]]), inv_freq)
            return float(jnp.sum(qm * kn))

        same_offset = [score(m, m - 3) for m in (3, 10, 57, 200)]
        np.testing.assert_allclose(same_offset, same_offset[0], rtol=1e-4, atol=1e-5)
        assert abs(score(10, 7) - score(10, 5)) > 1e-3  # other offsets score differently
        # and the rotation preserves the norm
        np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, jnp.array([[123]]), inv_freq)),
                                   jnp.linalg.norm(q), rtol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Presets: parameter counts against the published models.
# ---------------------------------------------------------------------------------------------------

PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,  # meta-llama/Llama-2-13b-hf
    "llama3-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen3-8b": 8_190_735_360,
    "llama3-70b": 70_553_706_496,
    "3.5b": 3_500_281_856,  # the first 16 layers of llama2-7b (embedding and head included)
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_param_count(name):
    """The preset shapes build the published models: counting nnx.Params of an abstract model (no
    memory allocated) agrees with cfg.param_count() and with the published parameter count."""
    cfg = preset(name)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    counted = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert counted == cfg.param_count() == PUBLISHED[name]


def test_3_5b_is_16_layers_of_7b():
    """The docs/design.md benchmark shape '3.5b' is llama2-7b cut to 16 layers, nothing else changed."""
    assert PRESETS["3.5b"] == PRESETS["7b"].replace(layers=16)
    assert PRESETS["7b"] == PRESETS["llama2-7b"]


# ---------------------------------------------------------------------------------------------------
# Bad configs fail early, naming the value and what is allowed.
# ---------------------------------------------------------------------------------------------------

def test_unknown_preset_names_it_and_lists_allowed():
    with pytest.raises(ValueError, match=r"unknown preset 'llama9-7b'") as err:
        preset("llama9-7b")
    assert "llama2-7b" in str(err.value) and "qwen3-8b" in str(err.value)


def test_unknown_family(make_cfg):
    with pytest.raises(ValueError, match=r"'gpt2'.*llama.*qwen3"):
        make_cfg(family="gpt2")


@pytest.mark.parametrize("field, typo, meant", [("family", "lama", "llama"), ("dtype", "bfloat61", "bfloat16"),
                                                ("attention_impl", "cudn", "cudnn")])
def test_enumerated_field_typo_says_did_you_mean(make_cfg, field, typo, meant):
    with pytest.raises(ValueError, match=rf"{typo!r}.*allowed.*did you mean {meant!r}\?"):
        make_cfg(**{field: typo})


def test_heads_must_divide_hidden(make_cfg):
    with pytest.raises(ValueError, match=r"heads=5 does not divide hidden=32"):
        make_cfg(heads=5, kv_heads=5)


def test_kv_heads_must_divide_heads(make_cfg):
    with pytest.raises(ValueError, match=r"kv_heads=3 does not divide heads=4"):
        make_cfg(kv_heads=3)


def test_unknown_config_field_in_replace(tiny_cfg):
    with pytest.raises(ValueError, match=r"unknown DecoderConfig field\(s\) \['hidden_size'\]"):
        tiny_cfg.replace(hidden_size=64)


# ---------------------------------------------------------------------------------------------------
# The stateless layer template.
# ---------------------------------------------------------------------------------------------------

def test_block_template_compiles_once_for_all_layers(make_cfg, build_model):
    """One jitted merge(graphdef, params)(x) serves every layer: identical blocks share one graphdef
    and their params share one tree structure, so the engine compiles each layer function once."""
    cfg = make_cfg(layers=4)
    model = build_model(cfg)
    graphdef, _ = nnx.split(model.blocks[0], nnx.Param)
    block_fn = jax.jit(lambda params, x, pos: nnx.merge(graphdef, params)(x, pos))
    x = jnp.ones((1, 8, cfg.hidden), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(8), (1, 8))
    outs = []
    for block in model.blocks:
        gd, params = nnx.split(block, nnx.Param)
        assert gd == graphdef
        outs.append(block_fn(params, x, pos))
    assert block_fn._cache_size() == 1
    # Different params really flow in (the template does not bake in block 0's weights) ...
    assert not np.allclose(outs[0], outs[1])
    # ... and the cache count is meaningful: a differently shaped block compiles again.
    other = build_model(cfg.replace(ffn=64, layers=1))
    block_fn(nnx.state(other.blocks[0], nnx.Param), x, pos)
    assert block_fn._cache_size() == 2


def test_io_embed_takes_positions_and_segment_ids_and_ignores_them(make_cfg, build_model, tokens):
    """The contract hands io.embed the positions and segment ids; the decoder's positions enter through
    RoPE in every block instead, so its embedding is the same whatever they are."""
    model = build_model(make_cfg())
    tok = jnp.asarray(tokens(2, 6, model.cfg.vocab_size))
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    plain = model.io.embed(tok, pos, None)
    np.testing.assert_array_equal(plain, model.io.embed(tok, pos[:, ::-1], jnp.ones((2, 6), jnp.int32)))
    np.testing.assert_array_equal(plain, np.asarray(pure_params(model)["io"]["embedding"])[np.asarray(tok)])


def _hf_yarn(head_dim, base, factor, original, beta_fast=32, beta_slow=1, truncate=True):
    """transformers' _compute_yarn_parameters, transcribed: (inv_freq, attention_factor)."""
    def correction_dim(rot):
        return (head_dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return inter * (1 - extra_factor) + extra * extra_factor, attention


@pytest.mark.parametrize("head_dim,base,factor,original,truncate", [
    (128, 10000.0, 4.0, 4096, True), (128, 1000000.0, 4.0, 32768, True), (64, 500000.0, 16.0, 8192, False)])
def test_yarn_frequencies_and_attention_factor_match_transformers(head_dim, base, factor, original, truncate):
    s = RopeScaling(kind="yarn", factor=factor, original_max_position=original, truncate=truncate)
    want, attention = _hf_yarn(head_dim, base, factor, original, truncate=truncate)
    np.testing.assert_allclose(rope_inv_freq(head_dim, base, s), want, rtol=1e-6)
    assert s.cos_sin_scale == pytest.approx(attention)
    inv = rope_inv_freq(head_dim, base, None)
    got = rope_inv_freq(head_dim, base, s)
    assert got[0] == pytest.approx(inv[0]) and got[-1] == pytest.approx(inv[-1] / factor)  # fast kept, slow scaled
    # the attention factor multiplies cos and sin: the rotated vector's norm grows by it
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1, 1, head_dim)), jnp.float32)
    scaled = apply_rope(q, jnp.array([[77]]), got, s.cos_sin_scale)
    assert float(jnp.linalg.norm(scaled)) == pytest.approx(float(jnp.linalg.norm(q)) * attention, rel=1e-5)


def test_linear_scaling_divides_every_frequency():
    s = RopeScaling(kind="linear", factor=4.0)
    np.testing.assert_allclose(rope_inv_freq(64, 10000.0, s), rope_inv_freq(64, 10000.0, None) / 4, rtol=1e-6)
    assert s.cos_sin_scale == 1.0
    with pytest.raises(ValueError, match="kind 'ntk' is not supported"):
        RopeScaling(kind="ntk")


@pytest.mark.parametrize("chunk", [8, 24, 1000])  # divides B*T, does not (padding), larger than B*T
def test_chunked_mlp_equals_whole_mlp_loss_and_gradients(chunk):
    """The MLP over token chunks (rematerialized per chunk) computes the same loss and gradients."""
    from megatrain_jax import Batch
    from megatrain_jax.reference import model_loss
    cfg = preset("tiny", layers=2)
    rng = np.random.default_rng(0)
    batch = Batch.from_windows(rng.integers(0, cfg.vocab_size, (2, 33))).filled()  # B*T = 64 tokens
    whole = Decoder(cfg, rngs=nnx.Rngs(0))
    chunked = Decoder(cfg.replace(mlp_chunk_tokens=chunk), rngs=nnx.Rngs(0))
    results = []
    for model in (whole, chunked):
        graphdef, params = nnx.split(model, nnx.Param)
        loss, grads = jax.jit(jax.value_and_grad(lambda p: model_loss(nnx.merge(graphdef, p), batch)))(params)
        results.append((loss, jax.tree.leaves(grads)))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_chunked_mlp_keeps_only_chunk_sized_activations_for_the_backward():
    """What the backward keeps: with chunks, no [tokens, ffn] residual of the whole sequence is saved."""
    cfg = preset("tiny", layers=1, ffn=512, hidden=64)
    x = jnp.ones((1, 256, cfg.hidden), jnp.float32)
    pos = jnp.arange(256)[None]
    sizes = {}
    for chunk in (None, 32):
        block = Decoder(cfg.replace(mlp_chunk_tokens=chunk), rngs=nnx.Rngs(0)).blocks[0]
        graphdef, params = nnx.split(block, nnx.Param)
        f = lambda p, x: nnx.merge(graphdef, p)(x, pos).sum()  # noqa: E731
        _, vjp_fn = jax.vjp(f, params, x)
        res = [leaf for leaf in jax.tree.leaves(vjp_fn) if hasattr(leaf, "shape")]
        sizes[chunk] = max(int(np.prod(leaf.shape)) for leaf in res if cfg.ffn in leaf.shape) if any(
            cfg.ffn in leaf.shape for leaf in res) else 0
    assert sizes[None] >= 256 * cfg.ffn  # the whole sequence's gate/up activations
    assert sizes[32] < 256 * cfg.ffn  # at most the weights and a chunk's worth


def _dot_operand_dtypes(jaxpr) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in a jaxpr, inner jaxprs (jit, scan, custom rules) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _dot_operand_dtypes(sub)
    return out


def test_the_heads_backward_products_take_the_compute_dtype(make_cfg, build_model):
    """The logits' float32 cotangent is cast to bfloat16 before the head's two backward products: left float32,
    XLA widens the other operand and runs them as float32 (TF32 on a GPU, 279 TFLOP/s against ~670 for the
    blocks' bfloat16 products in h200_layer_compute_flags_8d66b1b.json's trace)."""
    cfg = make_cfg(dtype="bfloat16")
    model = build_model(cfg)
    io = model.io
    h = jax.random.normal(jax.random.PRNGKey(1), (16, cfg.hidden), jnp.float32)
    loss = lambda h_TD: jnp.sum(jax.nn.log_softmax(io.unembed(h_TD))[:, 0])  # noqa: E731
    dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(h).jaxpr)
    assert len(dots) >= 2, dots  # the forward's product and the backward's
    assert all(d == ("bfloat16", "bfloat16") for d in dots), dots
    assert jax.grad(loss)(h).dtype == jnp.float32


def test_the_heads_gradients_match_float32_within_bfloat16_rounding():
    """The head's gradients with the cotangent rounded to bfloat16 equal the full float32 ones to bfloat16's
    precision, and the logits are exactly those of bfloat16 operands summed in float32."""
    from megatrain_jax.models.layers import logits_matmul
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(k[0], (4, 64, 64), jnp.float32)  # [B, T, D]: the plain loss's logits have rows
    w = 0.1 * jax.random.normal(k[1], (64, 300), jnp.float32)
    t = jax.random.randint(k[2], (4, 64), 0, 300)

    def nll(logits_fn):
        return lambda h, w: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits_fn(h, w)), t[..., None], -1))

    ours = nll(lambda h, w: logits_matmul(h, w, jnp.bfloat16))
    full = nll(lambda h, w: jnp.matmul(h, w, precision=HI))
    plain = jnp.matmul(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(logits_matmul(h, w, jnp.bfloat16)), np.asarray(plain))
    for g, g_ref in zip(jax.grad(ours, (0, 1))(h, w), jax.grad(full, (0, 1))(h, w)):
        assert g.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(g_ref)))
        assert float(jnp.max(jnp.abs(g - g_ref))) < 2e-2 * scale  # bfloat16 operands: ~2^-8 each
        assert float(jnp.linalg.norm(g - g_ref)) < 1e-2 * float(jnp.linalg.norm(g_ref))
    # in float32 the cast is nothing: the gradient is the plain one
    f32 = nll(lambda h, w: logits_matmul(h, w, jnp.float32))
    f32_plain = nll(lambda h, w: jnp.matmul(h, w, preferred_element_type=jnp.float32))
    for g, g_ref in zip(jax.grad(f32, (0, 1))(h, w), jax.grad(f32_plain, (0, 1))(h, w)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-6, atol=1e-7)
