"""The bytes of one block's compiled programs per micro-batch, from the model's shapes: what a forward keeps for
its backward (attention's kept residuals, the kept matrix products) and the scratch memory of each program
(``transient``: rules of thumb, each written from the tensors the program keeps and compared with XLA's memory
analysis). ``gpu_ledger`` places them in the step; where the GPU is at hand, XLA's own figures replace the
rules of thumb (``MemoryPlan.gpu_exact``).
"""

from __future__ import annotations

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.models.config import SINK_QUERY_CHUNK, SINK_WIDTH, DecoderConfig, cudnn_takes_heads
from megatrain_jax.plan.counts import activation_bytes, io_param_count, layer_param_count


def transient(c: DecoderConfig, kind: str, micro_rows: int, seq_len: int, sb: int, flash: bool,
               packed: bool = False, kept: bool = False) -> tuple[int, str]:
    """Scratch memory of the compiled function behind an op, a rule of thumb from the tensors it keeps per
    token. In brackets, XLA's memory analysis on the H100 (per micro-batch: 7B layer at 16K tokens / 3B at
    128K; it depends on the tokens, not on how they split into rows)."""
    ab = activation_bytes(c)
    q, kv, D, V = c.heads * c.dim_per_head, c.kv_heads * c.dim_per_head, c.hidden, c.vocab_size
    mt = micro_rows * seq_len
    # The MLP's width per token: a mixture of experts computes top_k experts' rows (and the shared
    # expert's), and also holds each routed copy of the token's input and output [tokens * top_k, D].
    # (A rule from the shapes; no MoE run has checked it yet.)
    F = c.ffn if c.moe is None else c.moe.top_k * c.moe.expert_ffn + (c.moe.shared_expert_ffn or 0) \
        + 2 * c.moe.top_k * D // 3
    mlp_t = mt if c.mlp_chunk_tokens is None else min(mt, c.mlp_chunk_tokens)  # tokens the MLP holds at once
    scores = 0 if flash else micro_rows * c.heads * seq_len * seq_len * (4 + ab)  # no flash: T x T scores
    if c.attention_sinks:
        scores = sink_scores(c, micro_rows, seq_len, packed)
    # A chunked MLP leaves the attention's tensors the larger part at long lengths; its lax.map also copies
    # the block's [T, D] input padded into chunks and stacks the chunks' gradients in the backward.
    # [Measured with experiments/studies/op_memory.py, one block, 32K-token chunks, above its outputs: forward 3B 512K
    # 6.0 GiB (this rule 5.0), 7B 256K 6.1 (6.0); backward 3B 256K 15.7 (16.0), 3B 512K 31.4 (30.5), 7B 128K
    # 11.2 (13.0), 7B 256K 22.2 (24.0)]
    chunked = mlp_t < mt
    if kind == "forward":  # [1.01 / 6.0 GiB, and 8B's 1.31 at 16K; this rule the same]
        if chunked and mt * (q + 2 * kv) > mlp_t * 3 * F:
            return mt * (q + 2 * kv) * ab + scores, "q, k and v (the MLP is chunked)"
        return mlp_t * 3 * F * ab + scores, "MLP gate, up and product"
    if kind == "backward":  # [7B: 1.85, 4.19, 8.38 GiB at 16K, 32K, 64K tokens; 3B: 2.88, 11.56 at 32K, 128K;
        #                        this rule 2.08, 4.17, 8.33; 2.94, 11.75; float32 weights add ~0.57 at 7B]
        weights = layer_param_count(c) * 4 if sb == 4 else 0  # their bf16 cast; the gradient in float32
        # cuDNN's packed layout: a float32 dQ workspace per possible document [rows x segments, N, T, H]
        # (one row of 32K tokens, 24 heads of 128, 64 segments: this rule 24 GiB, +29 GiB measured;
        # tests/assets/measured/h100_kernels.json)
        packed_ws = c.segments_per_row(seq_len) * mt * q * 4 if packed and flash else 0
        qs = 1 if kept else 2  # q, and the attention output unless it was kept (counted with the activations)
        copies = 2 * mt * D if chunked else 0  # the chunked MLP's padded input and stacked gradient
        return (max((mt * (5 * D + qs * q + 2 * kv) + mlp_t * 3 * F + copies) * ab, layer_param_count(c) * sb)
                + weights + 2 * scores + packed_ws,
                "what the recompute keeps for the VJP: norm outputs, residual, q, k, v, " +
                ("" if kept else "attention output, ") + "MLP gate, up and product, the residual's float32 "
                "gradient" + (", and the chunked MLP's padded input and stacked gradient" if chunked else ""))
    if kind == "head":  # [2.6 / 11.6 GiB; this rule 2.8 / 10.8]
        chunk = min(c.loss_chunk_tokens, mt)
        return (2 * chunk * V * 4 + io_param_count(c) * sb + mt * D * (ab + 4),
                f"one {chunk}-token chunk of float32 logits and their gradient, the io gradient, the final hidden "
                f"state and its float32 gradient")
    if kind == "embed_backward":  # [0.24 / 0.73 GiB; exact]
        return V * D * sb, "the dense embedding gradient"
    return 0, ""


def assumes_flash(c: DecoderConfig) -> bool:
    """Whether the plan assumes cuDNN's flash attention (a 16-bit model on a GPU; packed rows too, in cuDNN's
    packed layout, which needs a Hopper GPU). Never with attention sinks (GPT-OSS): their attention keeps nothing
    for the backward, and its scratch is ``sink_scores``."""
    if c.attention_sinks:
        return False
    return _cudnn(c)


def _cudnn(c: DecoderConfig) -> bool:
    return c.attention_impl == "cudnn" or (c.attention_impl == "auto" and c.dtype in ("bfloat16", "float16"))


def sink_scores(c: DecoderConfig, micro_rows: int, seq_len: int, packed: bool = False) -> int:
    """The scratch of GPT-OSS's attention with sinks at its largest over the model's layers, counted where a flash
    layer would count no scores (once in the forward, twice in the backward: ``transient``). Each layer kind is
    counted by the path ``layers.attend`` gives it; where that depends on the GPU (cuDNN takes heads up to 256 wide
    on Hopper, 128 before) the larger count is taken.

    - XLA's sink attention (``layers.sink_attention``: packed rows, a float32 model, heads cuDNN does not take):
      float32 scores and weights, and the weights cast for P.V, of one chunk of queries against the keys the chunk
      sees, a sliding layer's band (chunk + window - 1) or a full layer's every key.
    - cuDNN, full layer of unpacked rows: the sink as one more key (``layers.sink_as_key``, heads ``SINK_WIDTH``
      wider), no scores.
    - cuDNN, sliding layer of unpacked rows: plain flash attention rescaled by its log-sum-exp
      (``layers.sink_rescaled``), whose backward holds, per query head, a float32 dQ workspace and three 16-bit
      tensors of q's shape (the rescaled output gradient, the log-sum-exp's query term, the keys averaged by the
      weights): this count, a rule from the code, is half of what the backward's transient adds.
    [GPT-OSS-20B, 2 micro-batches of 8 x 2,048 tokens on the H100 (``results/h100_gpt_oss_20b_6l_v3_cli.json``):
    XLA's memory analysis of a sliding block's backward (starting the accumulator) 3.74 GiB, ``transient``'s 3.73]"""
    chunk = min(seq_len, SINK_QUERY_CHUNK)
    ab, H = activation_bytes(c), c.dim_per_head
    xla_band = micro_rows * c.heads * chunk * min(seq_len, chunk + (c.sliding_window or seq_len) - 1) * (8 + ab)
    xla_every = micro_rows * c.heads * chunk * seq_len * (8 + ab)
    rescaled = micro_rows * seq_len * c.heads * H * (4 + 3 * ab)
    scratch = 0
    for kind in {c.layer_type(i) for i in range(c.layers)}:
        sliding = kind == "sliding_attention"
        width = H if sliding else H + SINK_WIDTH  # the heads cuDNN would take
        some_gpu = _cudnn(c) and not packed and cudnn_takes_heads(width, hopper=True)
        every_gpu = some_gpu and cudnn_takes_heads(width, hopper=False)
        if not some_gpu:
            scratch = max(scratch, xla_band if sliding else xla_every)
        elif sliding:
            scratch = max(scratch, rescaled if every_gpu else max(rescaled, xla_band))
        elif not every_gpu:  # a full layer whose wider heads only Hopper's cuDNN takes
            scratch = max(scratch, xla_every)
    return scratch


def kept_bytes(c: DecoderConfig, e: EngineConfig, micro_rows: int, seq_len: int, flash: bool,
               packed: bool = False) -> int:
    """The residuals one block keeps from its forward to its backward per micro-batch
    (``EngineConfig.keep_residuals``): cuDNN flash attention's output [rows, T, heads, head_dim] in the
    compute dtype and its softmax statistics [rows, heads, T] in float32, in cuDNN's packed layout one
    such row of statistics per possible document (``segments_per_row``; measured on the H100,
    tests/test_remat.py). Nothing on XLA's attention."""
    if not (flash and e.keep_residuals):
        return 0
    ab = activation_bytes(c)
    stats = c.segments_per_row(seq_len) if packed else 1
    return micro_rows * seq_len * c.heads * (c.dim_per_head * ab + 4 * stats)


def products_bytes(c: DecoderConfig, micro_rows: int, seq_len: int, layer: int | None = None) -> int:
    """The matrix products one block keeps from its forward to its backward per micro-batch
    (``EngineConfig.kept_layers``; ``KEEP_PRODUCTS_POLICY``), in the compute dtype: every projection output
    the backward needs, i.e. q, k, v (with MLA its low-rank steps: the q and kv latents, the heads' queries,
    keys and values) and the o-projection's output; a dense MLP's gate and up (and its down projection's
    output where a norm follows it: ``norm_placement`` "post" or "sandwich"); a mixture of experts' router
    logits (counted as float32) and shared expert's gate and up (and output and gate logit, where that is
    gated), its routed experts' products being
    recomputed (they are batched by expert). Block ``layer``'s kind (default: the last block's). Checked
    against what the traced programs keep for each family (tests/test_remat.py); cuDNN's marked residuals
    come on top (``kept_bytes``)."""
    layer = c.layers - 1 if layer is None else layer
    ab, D, hd = activation_bytes(c), c.hidden, c.dim_per_head
    if c.mla is None:
        attn = (c.heads + 2 * c.kv_heads) * hd + D
    else:
        m = c.mla
        attn = ((m.q_lora_rank or 0) + c.heads * (m.qk_nope_dim + m.qk_rope_dim) + m.kv_lora_rank + m.qk_rope_dim
                + c.heads * (m.qk_nope_dim + m.v_dim) + D)
    after = D if c.norm_placement != "pre" else 0  # the MLP's output, which a norm reads
    router = 0
    if c.is_moe_layer(layer):
        shared = c.moe.shared_expert_ffn or 0
        # a gated shared expert also keeps its output and its one-unit gate (the gate's gradient needs both)
        mlp = 2 * shared + (D + 1 if shared and c.moe.shared_expert_gate else 0)
        router = c.moe.experts * 4
    else:
        mlp = 2 * c.ffn
    return micro_rows * seq_len * ((attn + mlp + after) * ab + router)
