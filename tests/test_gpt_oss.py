"""GPT-OSS (``family="gpt_oss"``): attention sinks, q/k/v/o biases, sliding and full layers alternating (two kinds
of block), YaRN untruncated; a biased router whose softmax over the top-k logits weights the experts, experts with
biases and the clamped SwiGLU, gate and up interleaved in one stored ``gate_up_proj``; MXFP4 experts in the released
checkpoints.

Logits parity with transformers' GptOssForCausalLM, the round trip and the live export check (transformers with
torch: tests/torch_side.py) of the ``gpt_oss`` fixture are in tests/test_hf.py with the other families. Here: the
MXFP4 fixture (its dequantization bit for bit against transformers', its logits, its export), the presets' sizes,
the released config.json, refusals, what each part of the fixture changes, the released RoPE, counts, the sink
attention's chunks, and the engine against the in-memory reference.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from megatrain_jax import EngineConfig, adamw
from megatrain_jax.hf import Checkpoint, UnsupportedConfig, config_from_hf, config_to_hf, load_hf, read_safetensors, save_hf
from megatrain_jax.hf.mxfp4 import dequantize_mxfp4
from megatrain_jax.models import MoEConfig, preset
from megatrain_jax.models.layers import sink_attention
from megatrain_jax.models.rope import rope_inv_freq
from test_deepseek_v3 import assert_counts_equal_the_model
from test_engine import run_both
from test_hf import FIXTURES, logits_of, model_from, rel_err

MXFP4 = FIXTURES / "gpt_oss_mxfp4"

# OpenAI's model card: gpt-oss-120b 116.83B total, 5.13B active; gpt-oss-20b 20.91B total, 3.61B active (active:
# the output head counted, the input embedding not).
PUBLISHED = {"gpt-oss-20b": (20.91e9, 3.61e9), "gpt-oss-120b": (116.83e9, 5.13e9)}

# The released config.json of openai/gpt-oss-120b, in transformers 4.x's spelling (gpt-oss-20b: 24 layers, 32 experts,
# the same otherwise); experts_per_token and initial_context_length are the original implementation's names, which
# transformers ignores.
_RELEASED_120B = dict(
    architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0, eos_token_id=200002,
    experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096,
    initializer_range=0.02, intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 18,
    max_position_embeddings=131072, model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4,
    num_hidden_layers=36, num_key_value_heads=8, num_local_experts=128, output_router_logits=False, pad_token_id=199999,
    quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                    "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    rms_norm_eps=1e-05, rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                      "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
    transformers_version="4.55.0.dev0", use_cache=True, vocab_size=201088)
RELEASED = {"gpt-oss-120b": _RELEASED_120B,
            "gpt-oss-20b": dict(_RELEASED_120B, num_hidden_layers=24, num_local_experts=32,
                                layer_types=["sliding_attention", "full_attention"] * 12)}

# A tiny GPT-OSS: sliding (a 3-token window) and full layers alternating, 4 experts, 2 per token, a load-balancing
# loss, the clamp low enough to act.
GPT_OSS = preset("tiny", layers=4, family="gpt_oss", head_dim=16, qkv_bias=True, o_bias=True, attention_sinks=True,
                 sliding_window=3, layer_types=("sliding_attention", "full_attention") * 2,
                 moe=MoEConfig(experts=4, top_k=2, expert_ffn=32, router_bias=True, expert_bias=True,
                               activation="clamped_swiglu", swiglu_limit=1.0, aux_loss_coef=0.02))


def _without_ids(cfg):
    return dataclasses.replace(cfg, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _load_mxfp4(folder=MXFP4):
    with pytest.warns(UserWarning, match=r"experts are MXFP4 \(4 \*_blocks / \*_scales pairs\)"):
        return load_hf(folder, dtype="float32")


# --- MXFP4 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_dequantizes_bit_for_bit_as_transformers(dtype):
    """Against transformers' ``convert_moe_packed_tensors`` (saved by the fixture script): layer 0's stored pairs,
    and a pair of every byte value over every exponent 0..255 (where 2^128 overflows)."""
    ref = read_safetensors(MXFP4 / "mxfp4_reference.safetensors")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    bits = np.uint16 if dtype == "bfloat16" else np.uint32
    names = [k.removesuffix(f".{dtype}") for k in ref if k.endswith(f".{dtype}")]
    assert "lut" in names and (dtype == "float32" or len(names) == 3)
    for name in names:
        ours = dequantize_mxfp4(ref[name + "_blocks"], ref[name + "_scales"], np_dtype)
        want = ref[f"{name}.{dtype}"]
        assert ours.dtype == want.dtype and ours.shape == want.shape
        np.testing.assert_array_equal(ours.view(bits), want.view(bits), err_msg=name)
    lut = dequantize_mxfp4(ref["lut_blocks"], ref["lut_scales"], np.float32)
    assert np.isinf(lut).any() and not np.isnan(lut).any()


def test_mxfp4_checkpoint_reads_dequantized_with_the_logits_of_transformers():
    """The released layout (``*_blocks`` / ``*_scales``, quantization_config mxfp4) reads as the model transformers
    runs on its dequantized experts (transformers loaded this folder itself with these logits)."""
    assert json.loads((MXFP4 / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert any(n.endswith("gate_up_proj_blocks") for n in Checkpoint(MXFP4).names())
    cfg, io, blocks = _load_mxfp4()
    ref = read_safetensors(MXFP4 / "mxfp4_reference.safetensors")
    gate_up = ref["model.layers.0.mlp.experts.gate_up_proj.bfloat16"].astype(np.float32)
    np.testing.assert_array_equal(blocks[0]["mlp"]["experts"]["gate"], gate_up[..., 0::2])
    np.testing.assert_array_equal(blocks[0]["mlp"]["experts"]["up"], gate_up[..., 1::2])
    err = rel_err(logits_of(model_from(cfg, io, blocks), MXFP4), np.load(MXFP4 / "logits.npy"))
    assert err < 1e-4, err


def test_mxfp4_export_is_unquantized_and_says_so(tmp_path):
    cfg, io, blocks = _load_mxfp4()
    with pytest.warns(UserWarning, match=r"MXFP4 -> bfloat16"):
        save_hf(tmp_path, cfg, io, blocks, dtype="bfloat16")
    names = Checkpoint(tmp_path).names()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(n.endswith(("_blocks", "_scales"))
                                                                         for n in names)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    with pytest.warns(UserWarning, match="MXFP4 -> float32"):
        save_hf(tmp_path / "f32", cfg, io, blocks, dtype="float32")
    cfg2, io2, blocks2 = load_hf(tmp_path / "f32", dtype="float32")  # the dequantized values, exactly
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves((io, blocks)), jax.tree.leaves((io2, blocks2))):
        np.testing.assert_array_equal(a, b)


def test_live_mxfp4_export_loads_in_transformers(tmp_path, hf_torch):
    cfg, io, blocks = _load_mxfp4()
    with pytest.warns(UserWarning, match="MXFP4"):
        save_hf(tmp_path, cfg, io, blocks, dtype="float32")
    got = hf_torch.logits(tmp_path, np.load(MXFP4 / "tokens.npy"))
    assert rel_err(got, np.load(MXFP4 / "logits.npy")) < 1e-4


# --- presets and config.json --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    cfg = preset(name)
    total, active = PUBLISHED[name]
    assert round(cfg.param_count() / 1e7) == round(total / 1e7), cfg.param_count()
    active_ours = cfg.active_param_count() - cfg.vocab_size * cfg.hidden  # the input embedding is a lookup
    assert round(active_ours / 1e7) == round(active / 1e7), active_ours


@pytest.mark.parametrize("spelling", ["4.x", "5.x"])
@pytest.mark.parametrize("name", list(RELEASED))
def test_released_config_json_reads_as_the_preset_and_writes_back(name, spelling):
    c = dict(RELEASED[name])
    if spelling == "5.x":  # transformers 5 keeps RoPE's fields in rope_parameters
        c["rope_parameters"] = {**c.pop("rope_scaling"), "rope_theta": c.pop("rope_theta")}
    cfg = config_from_hf(c)
    assert _without_ids(cfg) == preset(name)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.moe.aux_loss_coef) == (200002, 199999, 0.9)
    written = config_to_hf(cfg)
    assert written["model_type"] == "gpt_oss" and "quantization_config" not in written
    assert written["rope_parameters"]["truncate"] is False and written["layer_types"] == c["layer_types"]
    assert config_from_hf(written) == cfg


def test_config_json_fields_left_out_take_transformers_defaults():
    """GptOssConfig's defaults are gpt-oss-120b's shape, its YaRN at base 150,000 and layers alternating."""
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "router_aux_loss_coef")
    cfg = config_from_hf({k: v for k, v in RELEASED["gpt-oss-120b"].items() if k in keep})
    assert _without_ids(cfg) == preset("gpt-oss-120b")


@pytest.mark.parametrize("change, match", [
    (dict(quantization_config={"quant_method": "fp8"}), "only the released MXFP4"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(model_type="gpt_oss_2", architectures=["GptOss2ForCausalLM"]), r"supported model types: \[.*'gpt_oss'"),
])
def test_unsupported_configs_are_refused(change, match):
    with pytest.raises(UnsupportedConfig, match=match):
        config_from_hf(dict(RELEASED["gpt-oss-20b"], **change))


@pytest.mark.parametrize("change, match", [
    (dict(attention_sinks=False), "attention_sinks=False"),
    (dict(o_bias=False), "o_bias=False with qkv_bias=True"),
    (dict(moe=dataclasses.replace(GPT_OSS.moe, expert_bias=False)), "moe.expert_bias=False"),
    (dict(moe=dataclasses.replace(GPT_OSS.moe, shared_expert_ffn=16)), "no shared expert"),
])
def test_export_refuses_what_gpt_oss_cannot_hold(change, match):
    with pytest.raises(UnsupportedConfig, match=match):
        config_to_hf(GPT_OSS.replace(**change))
    with pytest.raises(UnsupportedConfig, match="attention_sinks=True"):
        config_to_hf(preset("mixtral-8x7b", layers=2).replace(attention_sinks=True))


# --- what the numbers depend on -------------------------------------------------------------------------------------

def test_released_rope_matches_transformers():
    """YaRN by 32 over 4,096 positions at base 150,000, untruncated: transformers' inv_freq (float32) and
    attention factor (0.1 ln 32 + 1) for head_dim 64, saved by the fixture script."""
    want = np.load(FIXTURES / "gpt_oss" / "rope_released.npz")
    cfg = preset("gpt-oss-20b")
    np.testing.assert_allclose(rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling), want["inv_freq"],
                               rtol=2e-7)
    assert cfg.rope_scaling.cos_sin_scale == pytest.approx(float(want["attention_scaling"]), rel=1e-12)
    truncated = rope_inv_freq(64, cfg.rope_theta, dataclasses.replace(cfg.rope_scaling, truncate=True))
    assert np.abs(truncated / want["inv_freq"] - 1).max() > 1e-3  # the flag matters at this shape


def test_each_part_of_the_fixture_changes_the_logits():
    """Sinks (as if absent: -1e9), the window, the clamp, YaRN and the interleave each move the gpt_oss fixture's
    logits: the parity in test_hf checks them all."""
    folder = FIXTURES / "gpt_oss"
    cfg, io, blocks = load_hf(folder, dtype="float32")
    want = np.load(folder / "logits.npy")
    assert rel_err(logits_of(model_from(cfg, io, blocks), folder), want) < 1e-5
    no_sinks = jax.tree.map(np.copy, blocks)
    for b in no_sinks:
        b["attn"]["sinks"][:] = -1e9
    swapped = jax.tree.map(np.copy, blocks)
    for b in swapped:
        e = b["mlp"]["experts"]
        e["gate"], e["up"], e["gate_bias"], e["up_bias"] = e["up"], e["gate"], e["up_bias"], e["gate_bias"]
    changed = [(cfg, no_sinks), (cfg.replace(sliding_window=100), blocks), (cfg.replace(rope_scaling=None), blocks),
               (cfg.replace(moe=dataclasses.replace(cfg.moe, swiglu_limit=100.0)), blocks), (cfg, swapped)]
    for c, b in changed:
        assert rel_err(logits_of(model_from(c, io, b), folder), want) > 1e-3


def test_sink_attention_in_chunks_equals_it_whole():
    """Query chunks (the linear-memory path of long sequences) give the whole attention's values and gradients,
    with a window (a band of keys per chunk where the window is short) and packed documents; sinks of -inf are
    plain softmax attention."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    B, T, N, K, H = 2, 13, 4, 2, 8
    q, k, v = (jax.random.normal(key, (B, T, n, H)) for key, n in ((k1, N), (k2, K), (k3, K)))
    sinks = jax.random.normal(k4, (N,))
    seg = jnp.asarray([[0] * 6 + [1] * 7, [0] * 13])
    for window, segments in ((None, None), (3, None), (5, seg), (12, seg)):  # banded keys for 3 and 5 (chunks of 4)
        def f(chunk, q, k, v, sinks):
            return sink_attention(q, k, v, sinks, 0.3, window, segments, chunk=chunk)
        whole, grads = jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(64, *a))), argnums=(0, 1, 2, 3))(q, k, v, sinks)
        parts, grads4 = jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(4, *a))), argnums=(0, 1, 2, 3))(q, k, v, sinks)
        np.testing.assert_allclose(parts, whole, rtol=1e-5)
        for a, b in zip(grads4, grads):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    plain = jax.nn.dot_product_attention(q, k, v, scale=0.3, is_causal=True, local_window_size=(2, 0))
    np.testing.assert_allclose(sink_attention(q, k, v, jnp.full((N,), -jnp.inf), 0.3, 3, None), plain, rtol=1e-5,
                               atol=1e-6)


def _equals_sink_attention(form, T: int, window: int | None, scale: float, bf16_tol: float) -> None:
    """``form(q, k, v, sinks)``, computed by XLA, against sink_attention: values and gradients (sinks included) in
    float32, grouped queries; on bfloat16 inputs within ``bf16_tol`` of sink_attention on the same inputs."""
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(T), 5)
    B, N, K, H = 2, 4, 2, 16
    q, k, v = (jax.random.normal(key, (B, T, n, H)) for key, n in ((k1, N), (k2, K), (k3, K)))
    sinks = 3 * jax.random.normal(k4, (N,))
    w = jax.random.normal(k5, (B, T, N, H))
    loss = lambda f: lambda *a: jnp.sum(w * f(*a))  # noqa: E731
    ref = lambda q, k, v, s: sink_attention(q, k, v, s, scale, window, None)  # noqa: E731
    want, want_g = jax.value_and_grad(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    got, got_g = jax.value_and_grad(loss(form), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(want_g[3]).max()) > 1e-3  # the sinks' gradient is there to compare
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))  # bfloat16 inputs, as on the GPU
    one = form(qb, kb, vb, sinks).astype(jnp.float32)
    two = sink_attention(*(x.astype(jnp.float32) for x in (qb, kb, vb)), sinks, scale, window, None)
    assert float(jnp.abs(one - two).max() / jnp.abs(two).max()) < bf16_tol


@pytest.mark.parametrize("T", [13, 64, 70])
def test_the_sink_as_one_more_key_equals_sink_attention(T):
    """``sink_as_key`` (how cuDNN's flash kernel takes a full layer's sinks) is plain causal attention over one more
    key; computed by XLA here, it gives sink_attention's values and gradients (sinks included) in float32, and in
    bfloat16 the sink logit keeps its float32 value (split over two 16-bit widths)."""
    from megatrain_jax.models.layers import sink_as_key
    _equals_sink_attention(lambda q, k, v, s: sink_as_key(q, k, v, s, 0.25, "xla"), T, None, 0.25, 1e-2)


@pytest.mark.parametrize("T,window", [(40, 8), (70, 16), (40, None), (13, 3)])
def test_sinks_by_rescaling_with_the_log_sum_exp_equal_sink_attention(T, window):
    """``sink_rescaled`` (a kernel's attention times sigmoid(lse - sink), the way cuDNN's flash kernel can take a
    sliding layer's sinks): computed by XLA here, sink_attention's values and gradients (sinks included) in float32,
    with a window and without, grouped queries; bfloat16 inputs within bfloat16's error."""
    from megatrain_jax.models.layers import sink_rescaled
    _equals_sink_attention(lambda q, k, v, s: sink_rescaled(q, k, v, s, 0.3, window, "xla"), T, window, 0.3, 2e-2)


def test_the_sink_key_keeps_the_sink_logit_beyond_bfloat16():
    """The two 16-bit widths carry ``sink / scale`` to ~2^-16 relative; one alone would round it to 2^-9."""
    from megatrain_jax.models.layers import sink_widths
    sinks = jnp.asarray([3.0303, -9.87654, 0.1234567, 20.2])
    pair = sink_widths(sinks, 0.125, jnp.bfloat16).astype(jnp.float32)
    assert pair.shape == (4, 2)
    np.testing.assert_allclose(0.125 * pair.sum(axis=1), sinks, rtol=2e-5)
    assert float(jnp.abs(0.125 * pair[:, 0] - sinks).max()) > 1e-3  # the remainder matters


def test_attend_takes_the_cudnn_forms_only_where_cudnn_runs_unpacked_rows(monkeypatch):
    """On a GPU that would run cuDNN, unpacked rows take its flash kernel: a full-attention layer with the sink as one
    more key, a sliding layer rescaled by its log-sum-exp. Packed rows keep XLA's sink attention (the sink key would
    leave a document, and cuDNN's packed layout returns no log-sum-exp), as do heads cuDNN does not take."""
    from megatrain_jax.models import layers
    calls = []
    monkeypatch.setattr(layers, "attention_implementation", lambda *a, **kw: "cudnn")
    monkeypatch.setattr(layers, "gpu_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(layers, "sink_as_key", lambda *a: calls.append("key") or a[0])
    monkeypatch.setattr(layers, "sink_rescaled", lambda *a: calls.append(("rescaled", a[5], a[6])) or a[0])
    monkeypatch.setattr(layers, "sink_attention", lambda *a: calls.append("xla") or a[0])
    q = jnp.zeros((1, 8, 4, 8), jnp.bfloat16)
    k = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
    sinks, seg = jnp.zeros((4,)), jnp.zeros((1, 8), jnp.int32)
    for window, segments in ((None, None), (4, None), (None, seg), (4, seg)):
        layers.attend(GPT_OSS, window, q, k, k, segments, sinks)
    assert calls == ["key", ("rescaled", 4, "cudnn"), "xla", "xla"]
    # heads that 8 more widths would take past cuDNN's limit (256 on Hopper, 128 before) stay on XLA when full;
    # a sliding layer of them still fits
    wide = jnp.zeros((1, 8, 4, 256), jnp.bfloat16)
    layers.attend(GPT_OSS, None, wide, wide[:, :, :2], wide[:, :, :2], None, sinks)
    layers.attend(GPT_OSS, 4, wide, wide[:, :, :2], wide[:, :, :2], None, sinks)
    assert calls[4:] == ["xla", ("rescaled", 4, "cudnn")]
    monkeypatch.setattr(layers, "gpu_compute_capability", lambda: (8, 0))
    q128, k128 = q.repeat(16, axis=-1), k.repeat(16, axis=-1)  # 128 wide: 136 is past the A100's limit
    layers.attend(GPT_OSS, None, q128, k128, k128, None, sinks)
    layers.attend(GPT_OSS, 4, q128, k128, k128, None, sinks)  # a sliding layer's 128 fits without the sink widths
    layers.attend(GPT_OSS, 4, wide, wide[:, :, :2], wide[:, :, :2], None, sinks)  # 256: past it
    assert calls[6:] == ["xla", ("rescaled", 4, "cudnn"), "xla"]


@pytest.mark.parametrize("head_dim", [64, 100, 120, 128, 136, 192, 256, 264])
def test_the_plan_counts_at_least_what_the_path_attend_takes_holds(monkeypatch, head_dim):
    """For each layer kind, head width and GPU generation, the plan's sink count (which knows no GPU) is at least
    the scratch of the path ``attend`` takes there: XLA's scores, the rescaled form's q-shaped tensors, or nothing
    for the sink as a key."""
    from megatrain_jax.models import layers
    from megatrain_jax.plan.activations import sink_scores
    monkeypatch.setattr(layers, "attention_implementation", lambda *a, **kw: "cudnn")
    path = []
    monkeypatch.setattr(layers, "sink_as_key", lambda *a: path.append("key") or a[0])
    monkeypatch.setattr(layers, "sink_rescaled", lambda *a: path.append("rescaled") or a[0])
    monkeypatch.setattr(layers, "sink_attention", lambda *a: path.append("xla") or a[0])
    rows, T, chunk = 2, 4096, 512
    base = preset("gpt-oss-20b", head_dim=head_dim)
    for kind, window in (("sliding_attention", base.sliding_window), ("full_attention", None)):
        cfg = base.replace(layer_types=(kind,) * base.layers)
        keys = min(T, chunk + window - 1) if window else T
        held = {"xla": rows * cfg.heads * chunk * keys * 10, "key": 0,
                "rescaled": rows * T * cfg.heads * head_dim * (4 + 3 * 2)}
        for cc in ((8, 0), (9, 0)):
            monkeypatch.setattr(layers, "gpu_compute_capability", lambda cc=cc: cc)
            q = jnp.zeros((1, 8, 4, head_dim), jnp.bfloat16)
            layers.attend(cfg, window, q, q[:, :, :2], q[:, :, :2], None, jnp.zeros((4,)))
            assert sink_scores(cfg, rows, T) >= held[path[-1]], (kind, cc, path[-1])


def test_counts_equal_the_model_parameters():
    """``param_count``, ``block_param_count`` and the memory plan's leaf shapes hold what the model holds (sinks,
    o bias, router bias, expert biases included)."""
    assert_counts_equal_the_model(GPT_OSS, ["sliding_attention", "full_attention"] * 2)


def test_engine_equals_reference():
    """The streamed engine trains a GPT-OSS of two kinds of block (sliding, full) as the in-memory jax.grad + optax
    reference does: three steps of two accumulated groups of two micro-batches, gradients clipped, the
    load-balancing loss on."""
    tx = lambda: adamw(1e-3, eps=1e-6, weight_decay=0.1)  # noqa: E731
    run_both(GPT_OSS, tx, EngineConfig(micro_batches=2, accumulate_steps=2, clip_norm=0.05))


def test_sliding_sink_attention_works_on_the_band_only():
    """A sliding layer's chunks take only the keys their window reaches: XLA's count of the program's
    floating-point operations falls with the band (here 8 + 4 - 1 of 256 keys a query)."""
    B, T, N, K, H = 1, 256, 4, 2, 8
    q = jnp.ones((B, T, N, H))
    k = v = jnp.ones((B, T, K, H))
    sinks = jnp.zeros((N,))

    def flops(window):
        f = jax.jit(lambda q, k, v: sink_attention(q, k, v, sinks, 0.3, window, None, chunk=8))
        cost = f.lower(q, k, v).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops(4) < 0.2 * flops(None)


def test_the_plan_counts_the_sink_attention_scores():
    """The plan's rule of thumb for a block's scratch memory counts what attention with sinks holds where flash
    attention would count nothing: on cuDNN (unpacked 16-bit rows) the sliding layers' rescale tensors and nothing
    for full layers; on XLA (packed rows, or a float32 model) the scores of one chunk of queries against a sliding
    layer's band of keys or a full layer's every key; and no kept residuals."""
    from megatrain_jax.plan.activations import sink_scores, transient
    cfg = preset("gpt-oss-20b")
    assert cfg.dtype == "bfloat16"
    rescaled = cfg.heads * 8192 * cfg.dim_per_head * (4 + 3 * 2)  # sliding layers on cuDNN: q-shaped tensors
    for kind, times in (("forward", 1), ("backward", 2)):
        with_sinks, _ = transient(cfg, kind, 1, 8192, 2, flash=False)
        flash, _ = transient(cfg.replace(attention_sinks=False), kind, 1, 8192, 2, flash=True)
        assert with_sinks - flash == pytest.approx(times * rescaled, abs=1024)  # + the sinks
    assert sink_scores(cfg, 1, 8192) == rescaled
    every, band = 8192, 512 + cfg.sliding_window - 1
    assert sink_scores(cfg, 1, 8192, packed=True) == cfg.heads * 512 * every * 10
    assert sink_scores(cfg.replace(dtype="float32"), 1, 8192) == cfg.heads * 512 * every * 12
    sliding_only = cfg.replace(layer_types=("sliding_attention",) * cfg.layers)
    assert sink_scores(sliding_only, 1, 8192, packed=True) == cfg.heads * 512 * band * 10
    full_only = cfg.replace(layer_types=("full_attention",) * cfg.layers)
    assert sink_scores(full_only, 1, 8192) == 0 and sink_scores(full_only, 1, 100) == 0
    # and keeps no residuals for the backward: cuDNN's output and statistics never exist
    from megatrain_jax.plan.activations import assumes_flash, kept_bytes
    assert not assumes_flash(cfg) and assumes_flash(cfg.replace(attention_sinks=False))
    kept = EngineConfig(keep_residuals=True)
    assert kept_bytes(cfg, kept, 1, 8192, assumes_flash(cfg)) == 0


def test_sinks_with_cudnn_attention_are_refused():
    """cuDNN's flash attention cannot take every layer with sinks (packed rows, some head widths): asking for it on
    a model with sinks is an error that says what to set (rather than a silent XLA path)."""
    with pytest.raises(ValueError, match="attention_sinks .* Leave attention_impl at 'auto'"):
        GPT_OSS.replace(attention_impl="cudnn")
    assert GPT_OSS.replace(attention_impl="xla").attention_impl == "xla"
