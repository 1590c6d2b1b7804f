"""Generate the tiny Hugging Face parity fixtures under tests/fixtures/hf/ (needs torch + transformers).

Each fixture is a random fp32 ``*ForCausalLM`` saved with ``save_pretrained(safe_serialization=True)``,
plus ``tokens.npy`` and the logits transformers computes for them (``logits.npy``). Weights are drawn
larger than transformers' init (and norms/biases non-trivial) so that attention is sharp and a wrong
mapping, RoPE or window changes the logits visibly. The JAX venv has no torch, so use a separate one:

    PYENV_VERSION=3.11.7 python3.11 -m venv /work/venv-hf
    /work/venv-hf/bin/pip install torch==2.13.0          # the CPU wheel on disk; install it first
    /work/venv-hf/bin/pip install transformers safetensors numpy accelerate  # accelerate: to load MXFP4 folders
    /work/venv-hf/bin/python scripts/make_hf_fixtures.py

Check that folders written by ``megatrain_jax.hf.save_hf`` load in transformers
(``AutoModelForCausalLM.from_pretrained``) and give the fixture's logits: export with the JAX venv,
then load with this one (``--against`` gives the folders whose tokens.npy / logits.npy to compare with):

    /work/venv/bin/python -c "from megatrain_jax.hf import load_hf, save_hf
    for n in ['llama', 'llama_tied_rope3', 'mistral', 'qwen2', 'qwen3', 'phi3', 'phi3_longrope', 'olmo2',
              'gemma3_text', 'glm4_moe', 'deepseek_v3', 'deepseek_v3_noqlora', 'gpt_oss', 'gpt_oss_mxfp4']:
        save_hf(f'/tmp/hf_export/{n}', *load_hf(f'tests/fixtures/hf/{n}'), dtype='float32')"
    /work/venv-hf/bin/python scripts/make_hf_fixtures.py --check-export /tmp/hf_export/* \
        --against tests/fixtures/hf/{deepseek_v3,deepseek_v3_noqlora,gemma3_text,glm4_moe,gpt_oss,gpt_oss_mxfp4,llama,llama_tied_rope3,mistral,olmo2,phi3,phi3_longrope,qwen2,qwen3}
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
SEQ, BATCH, VOCAB = 16, 2, 96
MAX_BYTES = 300 * 1024
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

FIXTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama_tied_rope3": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True,
                                                                  rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=20, rope_theta=1000000.0,
                                                      tie_word_embeddings=True)),
    # mixtures of experts (issue 18): 4 experts, 2 per token
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                                                            rope_theta=1000000.0, sliding_window=None,
                                                            router_aux_loss_coef=0.02)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=16, norm_topk_prob=True,
                                                                decoder_sparse_step=1, mlp_only_layers=[],
                                                                rope_theta=1000000.0)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=16,
                                                                shared_expert_intermediate_size=16,
                                                                norm_topk_prob=False, decoder_sparse_step=1,
                                                                mlp_only_layers=[], use_sliding_window=False,
                                                                rope_theta=1000000.0)),
    # Phi-3: fused qkv_proj / gate_up_proj, a sliding window (Phi-3-mini-4k's is 2047). pad_token_id: Phi3Config's
    # default (32000) is past this vocabulary
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=5, rope_theta=10000.0, pad_token_id=None)),
    # Phi-4-mini's shape of RoPE: longrope over 3/4 of each head, tied embeddings. The 16 tokens exceed the
    # original length of 8, so transformers takes the long factors; the attention factor is sqrt(1 + ln 16 / ln 8)
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=None, tie_word_embeddings=True, original_max_position_embeddings=8,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
                         "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]})),
    # OLMo 2: post-norm blocks, q/k RMSNorm over all heads (widths 64 and 32: grouped-query attention)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=500000.0)),
    # Gemma 3 text: sandwich norms offset from 1, GeGLU, scaled tied embeddings, per-head q/k norms, scores scaled
    # by query_pre_attn_scalar (24, not head_dim 16; heads x head_dim 64, twice hidden 32). Two sliding layers (a
    # 4-token window, RoPE base 100) and a full one (base 1000, linear scaling by 4); final logits soft-capped at 10
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], final_logit_softcapping=10.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # GLM-4.5 (heads x head_dim 64, twice hidden 32): a dense layer then two MoE ones; a sigmoid router over 8 experts in 4 groups (2 kept, 2 experts per
    # token) with a random correction bias (``make`` draws it: a buffer, not a parameter), weights renormalized and
    # scaled by 2.5; an ungated shared expert; q/k/v biases, per-head q/k norms, RoPE on half of each head
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, first_k_dense_replace=1, head_dim=16, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, norm_topk_prob=True,
        routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # DeepSeek-V3 (issue 34): multi-head latent attention with a low-rank q (q_lora_rank 24), a 16-wide kv latent,
    # query/key heads of 8 unrotated + 8 rotated dimensions (interleaved RoPE) and values 12 wide (not 16); YaRN
    # by 4 past 32 positions with mscale_all_dim 0.8 (cos/sin and the softmax scale both corrected); a dense layer
    # then two MoE ones: a sigmoid router over 8 experts in 4 groups (2 kept, 2 per token) with a random correction
    # bias, routed weights renormalized and scaled by 2.5, two shared experts (one MLP 2 x 16 wide)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=16,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8})),
    # DeepSeek-V3's other attention switches: a full q_proj (q_lora_rank null), biases (attention_bias: q_a/kv_a/o),
    # rotate-half RoPE (rope_interleave false), no scaling; values wider than query/key heads (20 > 8 + 4);
    # routing without groups or renormalization
    "deepseek_v3_noqlora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=4, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=20, attention_bias=True,
        rope_interleave=False, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, norm_topk_prob=False, routed_scaling_factor=1.5, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # GPT-OSS: attention sinks (drawn N(0, 1): ``randomize``), q/k/v/o biases, sliding (a 4-token window) and full
    # layers alternating by layer_types, YaRN by 4 over 8 positions without truncation (as the release: truncate
    # false); a router with a bias picking 2 of 4 experts, their gate/up fused and interleaved, with biases, and the
    # clamped SwiGLU (alpha 1.702, limit 1.5: low enough that the clamps act on these weights)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=32, intermediate_size=32, num_hidden_layers=3, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_local_experts=4,
        num_experts_per_tok=2, swiglu_limit=1.5, router_aux_loss_coef=0.02, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 8})),
    # GPT-OSS as released: the experts' gate_up_proj / down_proj stored as MXFP4 (``*_blocks``: two e2m1 values per
    # byte, ``*_scales``: a power-of-two exponent (bias 127) per 32 values), config.json with quantization_config
    # {"quant_method": "mxfp4"}. ``make`` writes random blocks and scales in the released layout, and beside them
    # transformers' own dequantization (``mxfp4_reference.safetensors``); the logits are the model holding
    # transformers' dequantized experts. intermediate 64: down_proj's rows are two 32-value groups
    "gpt_oss_mxfp4": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], num_local_experts=4, num_experts_per_tok=2,
        attention_bias=True)),
}
MXFP4 = ("gpt_oss_mxfp4",)  # fixtures whose experts are written as MXFP4


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter: matrices N(0, 0.15), norm scales 1 + N(0, 0.1), attention sinks N(0, 1), biases
    N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.ndim >= 2:  # matrices, and experts' stacked ones
                p.copy_(0.15 * noise)
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("sinks"):  # GPT-OSS's attention sinks: logits that compete with the scores
                p.copy_(noise)
            else:
                p.copy_(0.1 * noise)


def logits_of(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def make(name: str, seed: int) -> None:
    cfg_cls, model_cls, extra = FIXTURES[name]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():  # GLM-4.5's (DeepSeek-V3's) correction bias is a buffer: drawn too, so that it changes the choice
        for buffer, b in model.named_buffers():
            if buffer.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=torch.float32))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=(BATCH, SEQ), dtype=np.int32)
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    packed = quantize_experts(model, seed) if name in MXFP4 else None
    model.save_pretrained(out, safe_serialization=True)
    np.save(out / "tokens.npy", tokens)
    np.save(out / "logits.npy", logits_of(model, tokens))
    if packed is not None:
        write_mxfp4(out, packed, tokens)
    if name == "gpt_oss":  # the released models' RoPE (GptOssConfig's defaults: head_dim 64, YaRN by 32 over 4,096)
        rope = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(transformers.GptOssConfig())
        np.savez(out / "rope_released.npz", inv_freq=rope.inv_freq.numpy(), attention_scaling=rope.attention_scaling)
    size = sum(p.stat().st_size for p in out.iterdir())
    assert size < MAX_BYTES, f"{name}: {size} bytes"
    print(f"{name}: {size / 1024:.1f} KiB, logits max |x| {np.abs(np.load(out / 'logits.npy')).max():.3f}")


def quantize_experts(model: torch.nn.Module, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random MXFP4 experts in the released layout, put into ``model`` as transformers dequantizes them
    (``convert_moe_packed_tensors``, float32). ``*_blocks`` [experts, out, in / 32, 16] uint8 (value 2j in the low
    nibble of byte j, 2j + 1 in the high one), ``*_scales`` [experts, out, in / 32] uint8 (2^(scale - 127));
    exponents 118..123: values of at most 6 x 2^-4, about the size of ``randomize``'s."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(seed + 2000)
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            experts, d_in, d_out = p.shape  # stored [experts, in, out]
            blocks = torch.randint(0, 256, (experts, d_out, d_in // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(118, 124, (experts, d_out, d_in // 32), generator=g, dtype=torch.uint8)
            p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed[name] = (blocks, scales)
    return packed


def write_mxfp4(out: Path, packed: dict[str, tuple[torch.Tensor, torch.Tensor]], tokens: np.ndarray) -> None:
    """Replace the saved experts by their ``*_blocks`` / ``*_scales``, add the release's quantization_config, and
    write ``mxfp4_reference.safetensors``: transformers' dequantization of layer 0's two pairs (in bfloat16: their
    exponents leave every value exact there) and of a pair that covers every byte and every exponent 0..255
    (``lut.*``, in float32 and bfloat16: exponent 255, where larger values overflow to inf, included). Check
    that transformers loads the folder (on a CPU without triton it dequantizes MXFP4 to the parameters' dtype;
    needs accelerate) with the logits saved."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    tensors = load_file(out / "model.safetensors")
    reference = {}
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(16, 1)  # [256, 16]: each row all 256
    lut_blocks = every_byte[None, :, None, :].contiguous()  # [1, 256, 1, 16]
    lut_scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None, :, None].contiguous()  # [1, 256, 1]
    for name, (blocks, scales) in [*packed.items(), ("lut", (lut_blocks, lut_scales))]:
        if name != "lut":
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        if name != "lut" and ".layers.0." not in name:
            continue
        reference[name + "_blocks"], reference[name + "_scales"] = blocks, scales
        for dtype in (torch.float32, torch.bfloat16) if name == "lut" else (torch.bfloat16,):  # exact in bf16
            reference[f"{name}.{str(dtype).removeprefix('torch.')}"] = convert_moe_packed_tensors(
                blocks.clone(), scales.clone(), dtype=dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    save_file(reference, out / "mxfp4_reference.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    err = float(np.abs(logits_of(model.eval(), tokens) - np.load(out / "logits.npy")).max())
    print(f"{out.name}: transformers loads the MXFP4 folder ({type(model).__name__}); max |logits error| {err:.2e}")
    assert err == 0.0, err


def check_export(folder: Path, reference: Path, tolerance: float = 1e-4) -> None:
    """Load an exported folder with AutoModelForCausalLM; compare with the reference's logits.npy."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    got = logits_of(model, np.load(reference / "tokens.npy"))
    err = float(np.abs(got - np.load(reference / "logits.npy")).max() / np.abs(got).max())
    print(f"{folder}: {type(model).__name__} loaded; max relative logits error vs {reference}: {err:.2e}")
    assert err < tolerance, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check-export", type=Path, nargs="*", help="exported folders to load and check")
    ap.add_argument("--against", type=Path, nargs="*", help="folders with tokens.npy + logits.npy, one per "
                    "exported folder (default: the exported folder itself)")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="max relative logits error")
    ap.add_argument("--only", nargs="*", help="make only these fixtures (default: all)")
    args = ap.parse_args()
    if args.check_export:
        against = args.against or args.check_export
        assert len(against) == len(args.check_export), "give one --against folder per exported folder"
        for folder, reference in zip(args.check_export, against):
            check_export(folder, reference, args.tolerance)
        return
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for seed, name in enumerate(FIXTURES):  # a fixture's seed is its place in FIXTURES: add new ones last
        if not args.only or name in args.only:
            make(name, seed)
    (OUT / "VERSIONS.json").write_text(json.dumps(
        {"torch": torch.__version__, "transformers": transformers.__version__}, indent=2) + "\n")


if __name__ == "__main__":
    main()
