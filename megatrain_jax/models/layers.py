"""Building blocks of the decoder: linear, RMSNorm, attention (RoPE in ``models.rope``), gated MLP.

Parameters are float32 (the master copy); each module casts them to the compute dtype of its input.
Shape suffixes: B batch, T tokens, D hidden, N query heads, K kv heads, H head dim, F ffn.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.contract.remat import keep_residuals
from megatrain_jax.models.config import SINK_QUERY_CHUNK, SINK_WIDTH, DecoderConfig, cudnn_takes_heads
from megatrain_jax.models.rope import apply_rope, rope_frequencies

_init_normal = nnx.initializers.normal(stddev=0.02)


class Linear(nnx.Module):
    """``y = x @ W (+ b)`` with W stored [in, out] in float32."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init_normal(rngs.params(), (d_in, d_out), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...].astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def logits_matmul(h_D: jax.Array, w_DV: jax.Array, dtype) -> jax.Array:
    """``h @ w`` (h [..., D]) with both cast to ``dtype`` (the compute dtype), the products summed into float32.

    Its backward casts the float32 cotangent to ``dtype`` too, so both of its products take ``dtype`` operands
    (accumulating in float32, the gradients returned in the inputs' dtypes). Differentiated as written, the
    cotangent would stay float32, and XLA would widen the other operand to meet it: the head's two backward
    products then run as float32 (TF32 on a GPU's tensor cores), at under half the bfloat16 rate. Rounding the
    cotangent to ``dtype`` is what mixed precision does there (torch's autocast, Liger's fused cross-entropy)."""
    return _logits_matmul_fwd(h_D, w_DV, dtype)[0]


def _logits_matmul_fwd(h_D, w_DV, dtype):
    h_c, w_c = h_D.astype(dtype), w_DV.astype(dtype)
    # the inputs' dtypes ride along as empty arrays (residuals must be arrays)
    return (jnp.matmul(h_c, w_c, preferred_element_type=jnp.float32),
            (h_c, w_c, jnp.zeros((0,), h_D.dtype), jnp.zeros((0,), w_DV.dtype)))


def _logits_matmul_bwd(dtype, res, g_V):
    h_c, w_c, h_like, w_like = res
    g_c = g_V.astype(dtype)
    dh = jnp.matmul(g_c, w_c.T, preferred_element_type=jnp.float32).astype(h_like.dtype)
    h_c, g_c = h_c.reshape(-1, h_c.shape[-1]), g_c.reshape(-1, g_c.shape[-1])  # the tokens of every row
    dw = jnp.matmul(h_c.T, g_c, preferred_element_type=jnp.float32).astype(w_like.dtype)
    return dh, dw


logits_matmul.defvjp(_logits_matmul_fwd, _logits_matmul_bwd)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32; the output has the input's dtype (as in Hugging Face Llama). With
    ``unit_offset`` the weight is an offset from 1 (``y * (1 + w)``, w starting at 0: Gemma 3)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        self.scale = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), jnp.float32))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = 1.0 + self.scale[...] if self.unit_offset else self.scale[...]
        return (scale * y).astype(x.dtype)


def gpu_compute_capability() -> tuple[int, int] | None:
    """The default device's CUDA compute capability, e.g. (9, 0) for Hopper; None off NVIDIA GPUs."""
    if jax.default_backend() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    return None if cc is None else tuple(int(v) for v in str(cc).split("."))[:2]


def attention_implementation(cfg: DecoderConfig, dtype, packed: bool = False) -> str:
    """cuDNN flash attention on GPU for 16-bit inputs, XLA otherwise. Packed rows (segment ids) take
    cuDNN's packed layout, which needs a Hopper GPU or later: on older ones they take XLA's masked path."""
    if cfg.attention_impl != "auto":
        return cfg.attention_impl
    cc = gpu_compute_capability()
    if cc is None or dtype not in (jnp.bfloat16, jnp.float16) or (packed and cc < (9, 0)):
        return "xla"
    return "cudnn"


def segment_layout(segment_ids_BT: jax.Array, max_segments: int) -> dict[str, jax.Array]:
    """The packed layout cuDNN takes, from segment ids: each row's runs of equal ids are its documents.

    ``lengths`` [B, M] and ``offsets`` [B, M + 1] (M = ``max_segments``) hold each run's length and first
    token, -1 past the row's last run. A row with more than M runs has its excess merged into its M-th
    (wrong attention): ``megatrain_jax.batch.check_segments`` refuses such batches before they run."""
    B, T = segment_ids_BT.shape
    starts_BT = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    starts_BM = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments, fill_value=T)[0])(starts_BT).astype(jnp.int32)
    ends_BM = jnp.concatenate([starts_BM[:, 1:], jnp.full((B, 1), T, jnp.int32)], axis=1)
    real_BM = starts_BM < T
    lengths = jnp.where(real_BM, ends_BM - starts_BM, -1)
    offsets = jnp.concatenate([jnp.where(real_BM, starts_BM, -1), jnp.full((B, 1), -1, jnp.int32)], axis=1)
    return {"lengths": lengths, "offsets": offsets}


def packed_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segment_ids_BT: jax.Array,
                     max_segments: int, sliding_window: int | None = None, scale: float | None = None) -> jax.Array:
    """Causal attention within each packed document, by cuDNN's flash kernel on its packed layout: each
    document costs its own causal attention and no [T, T] mask exists. GPU (Hopper or later) only; the XLA
    path with a segment mask is its reference."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    lay = segment_layout(segment_ids_BT, max_segments)
    return dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, q_seqlen=lay["lengths"], kv_seqlen=lay["lengths"], q_offsets=lay["offsets"],
        kv_offsets=lay["offsets"], scale=1.0 / math.sqrt(q_BTNH.shape[-1]) if scale is None else scale, mask_type=MaskType.PADDING_CAUSAL,
        sliding_window_length=sliding_window)


def sink_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, sinks_N: jax.Array, scale: float,
                   window: int | None, segment_ids_BT: jax.Array | None, chunk: int = SINK_QUERY_CHUNK) -> jax.Array:
    """Causal grouped-query attention with attention sinks (GPT-OSS; transformers' ``eager_attention_forward`` of
    ``modeling_gpt_oss``): each head's softmax runs over its scores and its sink logit ``sinks_N[n]``, whose weight
    is then dropped, so the weights of a row sum to less than 1. Scores, softmax and sink in float32; the weights
    are cast to v's dtype for the P.V product. ``window``: a sliding window's length (a query sees itself and the
    window - 1 keys before it), or None; ``segment_ids_BT``: packed documents attend within their own.

    Written in XLA ops: the reference of the cuDNN forms (``sink_as_key`` for full layers of unpacked rows,
    ``sink_rescaled`` for sliding ones), and the path of packed rows. Over ``chunk`` queries at a time (a ``lax.map``
    whose body is rematerialized): the scores of one chunk, [B, N, chunk, T], exist at once, so memory grows
    linearly with the sequence, not with its square; the backward recomputes each chunk's scores. On a sliding
    layer a chunk takes only the band of keys its window reaches ([B, N, chunk, chunk + window - 1] scores), so
    its work grows linearly with the sequence too."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    sinks_KG = sinks_N.astype(jnp.float32).reshape(K, N // K)

    def one(q_BCNH, pos_C, seg_BC, k_BSKH, v_BSKH, keys_S, kseg_BS):
        C = q_BCNH.shape[1]
        s_BKGCS = jnp.einsum("bckgh,bskh->bkgcs", q_BCNH.reshape(B, C, K, N // K, H), k_BSKH,
                             preferred_element_type=jnp.float32) * jnp.float32(scale)
        see_CS = (pos_C[:, None] >= keys_S[None, :]) & (keys_S[None, :] >= 0)
        if window is not None:
            see_CS = see_CS & (pos_C[:, None] - keys_S[None, :] < window)
        see = see_CS[None, None, None]
        if seg_BC is not None:
            see = see & (seg_BC[:, None, None, :, None] == kseg_BS[:, None, None, None, :])
        s_BKGCS = jnp.where(see, s_BKGCS, -jnp.inf)
        sink = sinks_KG[None, :, :, None, None]
        top = jax.lax.stop_gradient(jnp.maximum(jnp.max(s_BKGCS, axis=-1, keepdims=True), sink))  # a shift only
        p_BKGCS = jnp.exp(s_BKGCS - top)
        p_BKGCS = p_BKGCS / (jnp.sum(p_BKGCS, axis=-1, keepdims=True) + jnp.exp(sink - top))
        out = jnp.einsum("bkgcs,bskh->bckgh", p_BKGCS.astype(v_BSKH.dtype), v_BSKH)
        return out.reshape(B, C, N, H)

    if T <= chunk:
        return one(q_BTNH, jnp.arange(T), segment_ids_BT, k_BTKH, v_BTKH, jnp.arange(T), segment_ids_BT)
    n = -(-T // chunk)
    pad = n * chunk - T
    q_nBCNH = jnp.pad(q_BTNH, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, n, chunk, N, H).swapaxes(0, 1)
    pos_nC = jnp.arange(n * chunk).reshape(n, chunk)  # padding queries (past T) see every key; they are cut
    seg_nBC = None if segment_ids_BT is None else jnp.pad(
        segment_ids_BT, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
    band = None if window is None else chunk + window - 1
    if band is None or band >= T:  # every chunk against every key
        body = jax.checkpoint(lambda a: one(a[0], a[1], a[2], k_BTKH, v_BTKH, jnp.arange(T), segment_ids_BT))
        out_nBCNH = jax.lax.map(body, (q_nBCNH, pos_nC, seg_nBC))
    else:
        # A sliding window: a chunk's queries [c, c + chunk) see keys [c - window + 1, c + chunk) only, so each
        # chunk takes that band of the keys (left-padded by window - 1; padding keys, at negative positions, are
        # masked): the work falls from T to chunk + window - 1 keys a query.
        lead = window - 1
        k_p = jnp.pad(k_BTKH, ((0, 0), (lead, pad), (0, 0), (0, 0)))
        v_p = jnp.pad(v_BTKH, ((0, 0), (lead, pad), (0, 0), (0, 0)))
        kseg_p = None if segment_ids_BT is None else jnp.pad(segment_ids_BT, ((0, 0), (lead, pad)))
        slab = lambda x, c: jax.lax.dynamic_slice_in_dim(x, c, band, axis=1)  # noqa: E731

        def banded(a):
            q_BCNH, pos_C, seg_BC = a
            c = pos_C[0]
            return one(q_BCNH, pos_C, seg_BC, slab(k_p, c), slab(v_p, c), c - lead + jnp.arange(band),
                       None if kseg_p is None else slab(kseg_p, c))

        out_nBCNH = jax.lax.map(jax.checkpoint(banded), (q_nBCNH, pos_nC, seg_nBC))
    return out_nBCNH.swapaxes(0, 1).reshape(B, n * chunk, N, H)[:, :T]


def attention_lse(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, scale: float, window: int | None,
                  implementation: str) -> tuple[jax.Array, jax.Array]:
    """Causal attention (a sliding window of ``window`` keys, or None) and each query head's log-sum-exp of its
    scaled scores, [B, T, N] in float32: by cuDNN's flash kernel (whose softmax statistics ``jax.nn``'s wrapper
    would round to the inputs' dtype, so taken from its cuDNN call), or by XLA. Only the output's gradient is
    defined: the log-sum-exp's cotangent must be zero (``sink_rescaled`` adds its gradient itself)."""
    if implementation == "cudnn":
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
        out, lse_BNT = dot_product_attention(q_BTNH, k_BTKH, v_BTKH, scale=scale, mask_type=MaskType.CAUSAL,
                                             sliding_window_length=window, return_residual=True)
        return out, jnp.swapaxes(lse_BNT, 1, 2).astype(jnp.float32)
    local = None if window is None else (window - 1, 0)
    out, lse_BTN = jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, scale=scale, is_causal=True,
                                                local_window_size=local, implementation=implementation,
                                                return_residual=True)
    return out, lse_BTN.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def sink_rescaled(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, sinks_N: jax.Array, scale: float,
                  window: int | None, implementation: str) -> jax.Array:
    """``sink_attention`` by any causal attention kernel that returns its log-sum-exp (cuDNN's flash kernel, with a
    sliding window too): a sink adds ``exp(sink)`` to each softmax's denominator, so the output is plain
    attention's times ``sigmoid(lse - sink)``. The backward is plain attention's for the rescaled output's
    gradient, plus the log-sum-exp's own (its derivative by a score is that score's weight): for q, the keys
    averaged by the weights (attention with the keys as values), for k, the value-gradient of attention whose
    output gradient is each query's log-sum-exp gradient times the query. So a sliding layer costs plain
    attention's forward, then two forwards and two backwards."""
    return _sink_rescaled_fwd(q_BTNH, k_BTKH, v_BTKH, sinks_N, scale, window, implementation)[0]


def _sink_rescaled_fwd(q_BTNH, k_BTKH, v_BTKH, sinks_N, scale, window, implementation):
    (o_BTNH, lse_BTN), pull = jax.vjp(lambda q, k, v: attention_lse(q, k, v, scale, window, implementation),
                                      q_BTNH, k_BTKH, v_BTKH)
    w_BTN = jax.nn.sigmoid(lse_BTN - sinks_N.astype(jnp.float32))  # the weight the sink leaves the keys
    out = (o_BTNH.astype(jnp.float32) * w_BTN[..., None]).astype(o_BTNH.dtype)
    return out, (pull, q_BTNH, k_BTKH, o_BTNH, w_BTN, sinks_N)


def _sink_rescaled_bwd(scale, window, implementation, res, dy_BTNH):
    pull, q_BTNH, k_BTKH, o_BTNH, w_BTN, sinks_N = res
    dy = dy_BTNH.astype(jnp.float32)
    dlse_BTN = jnp.sum(dy * o_BTNH.astype(jnp.float32), axis=-1) * w_BTN * (1 - w_BTN)
    dq, dk, dv = pull(((dy * w_BTN[..., None]).astype(o_BTNH.dtype), jnp.zeros_like(w_BTN)))
    # the log-sum-exp's gradient: sum_j p_ij (scale k_j) into q_i and sum_i p_ij (scale dlse_i q_i) into k_j
    kbar_BTNH, pull_v = jax.vjp(lambda v: attention_lse(q_BTNH, k_BTKH, v, scale, window, implementation)[0],
                                k_BTKH)
    c_BTN1 = (scale * dlse_BTN)[..., None]
    (dk_lse,) = pull_v((c_BTN1 * q_BTNH.astype(jnp.float32)).astype(k_BTKH.dtype))
    dq = (dq.astype(jnp.float32) + c_BTN1 * kbar_BTNH.astype(jnp.float32)).astype(q_BTNH.dtype)
    dk = (dk.astype(jnp.float32) + dk_lse.astype(jnp.float32)).astype(k_BTKH.dtype)
    dsinks = (-jnp.sum(dlse_BTN, axis=(0, 1))).astype(sinks_N.dtype)
    return dq, dk, dv, dsinks


sink_rescaled.defvjp(_sink_rescaled_fwd, _sink_rescaled_bwd)


def cudnn_head_fits(head_dim: int) -> bool:
    """Whether this GPU's cuDNN flash attention takes heads this wide (``config.cudnn_takes_heads``)."""
    cc = gpu_compute_capability()
    return cc is not None and cudnn_takes_heads(head_dim, hopper=cc >= (9, 0))


def sink_key_fits_cudnn(head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes heads ``SINK_WIDTH`` wider (``sink_as_key``)."""
    return cudnn_head_fits(head_dim + SINK_WIDTH)


def sink_widths(sinks_N: jax.Array, scale: float, dtype) -> jax.Array:
    """[N, 2] in ``dtype``: ``sinks_N / scale`` as a rounded part and the rounded remainder, whose sum (times
    ``scale``) is the sink to ~2^-16 relative in 16 bits (rounded alone: 2^-9)."""
    s_N = sinks_N.astype(jnp.float32) / scale
    hi_N = s_N.astype(dtype)
    return jnp.stack([hi_N, (s_N - hi_N.astype(jnp.float32)).astype(dtype)], axis=1)


def sink_as_key(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, sinks_N: jax.Array, scale: float,
                implementation: str) -> jax.Array:
    """``sink_attention`` without a window or packed documents, as plain causal attention (so cuDNN's flash kernel
    takes it): one more key, first in the sequence, that every query sees, whose value is zero and whose score is
    the query head's sink logit. The heads widen by ``SINK_WIDTH``: each query carries its head's ``sink / scale``
    (split into a 16-bit part and its 16-bit remainder, so that their sum keeps the sink to ~2^-16), the sink key
    ones in those two places, every other key zeros; so a query's score against the sink key is the sink, and
    against the others what it was. A dummy query comes first with the sink key (its output is cut), and the
    length is padded at the end to a multiple of 64, which no real query sees under the causal mask. The gradient
    reaches the sinks through the queries' extra widths."""
    B, T, N, H = q_BTNH.shape
    K, dt = k_BTKH.shape[2], q_BTNH.dtype
    L = -(-(T + 1) // 64) * 64
    # broadcast in float32, then cast (the same values): the sinks' gradient sums over B x T in float32
    extra_N8 = jnp.pad(sink_widths(sinks_N, scale, dt).astype(jnp.float32), ((0, 0), (0, SINK_WIDTH - 2)))
    q = jnp.concatenate([q_BTNH, jnp.broadcast_to(extra_N8, (B, T, N, SINK_WIDTH)).astype(dt)], axis=-1)
    k = jnp.pad(k_BTKH, ((0, 0), (0, 0), (0, 0), (0, SINK_WIDTH)))
    sink_key = jnp.zeros((B, 1, K, H + SINK_WIDTH), dt).at[..., H:H + 2].set(1)
    k = jnp.concatenate([sink_key, k], axis=1)
    v = jnp.pad(v_BTKH, ((0, 0), (1, 0), (0, 0), (0, SINK_WIDTH)))  # the sink's value: zeros
    q = jnp.pad(q, ((0, 0), (1, L - T - 1), (0, 0), (0, 0)))  # the dummy query first; padding at the end
    k, v = (jnp.pad(x, ((0, 0), (0, L - T - 1), (0, 0), (0, 0))) for x in (k, v))
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)
    return out[:, 1:T + 1, :, :H]


def attend(cfg: DecoderConfig, window: int | None, q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
           segment_ids_BT: jax.Array | None, sinks_N: jax.Array | None = None) -> jax.Array:
    """Causal attention of rotated q, k and v (scores scaled by ``cfg.attention_scale``) by the path
    ``attention_implementation`` picks: cuDNN's flash attention (packed documents by its packed layout), or XLA
    (packed documents by a segment mask); ``window``: a sliding window's length, or None. With attention sinks
    (``sinks_N``, GPT-OSS), where cuDNN would run on unpacked rows: a full-attention layer takes it with the sink as
    one more key (``sink_as_key``), a sliding layer as plain attention rescaled by its log-sum-exp
    (``sink_rescaled``); packed rows, and heads cuDNN does not take, take XLA's ``sink_attention``."""
    qk_scale = cfg.attention_scale
    impl = attention_implementation(cfg, q_BTNH.dtype, packed=segment_ids_BT is not None)
    if sinks_N is not None:
        if impl == "cudnn" and segment_ids_BT is None:
            H = q_BTNH.shape[-1]
            if window is None and sink_key_fits_cudnn(H):
                return sink_as_key(q_BTNH, k_BTKH, v_BTKH, sinks_N, qk_scale, "cudnn")
            if window is not None and cudnn_head_fits(H):
                return sink_rescaled(q_BTNH, k_BTKH, v_BTKH, sinks_N, qk_scale, window, "cudnn")
        return sink_attention(q_BTNH, k_BTKH, v_BTKH, sinks_N, qk_scale, window, segment_ids_BT)
    # cuDNN's flash attention: its output and softmax statistics, one activation's worth, are marked to
    # keep for the backward (``megatrain_jax.contract.remat``), which then skips a second attention forward.
    if segment_ids_BT is not None and impl == "cudnn":  # packed documents: per-document flash attention
        max_segments = cfg.segments_per_row(q_BTNH.shape[1])
        return keep_residuals(lambda q, k, v, s: packed_attention(q, k, v, s, max_segments, window, qk_scale))(
            q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)
    if impl == "cudnn":
        local = None if window is None else (window - 1, 0)
        return keep_residuals(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=qk_scale, is_causal=True, local_window_size=local, implementation="cudnn"))(
            q_BTNH, k_BTKH, v_BTKH)
    mask = None
    if segment_ids_BT is not None:  # packed documents attend only within their own segment
        mask = (segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :])
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, mask=mask, scale=qk_scale, is_causal=True,
                                        local_window_size=local, implementation=impl)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE; optional q/k/v bias, o bias, q/k norm (per head, or over all
    heads before RoPE), attention sinks (one logit per head: ``sinks``, GPT-OSS) and sliding window:
    ``window`` is ``cfg.sliding_window`` on a layer of type "sliding_attention" (``cfg.layer_type``), None on
    a "full_attention" one; ``layer_type`` is the layer's RoPE (``cfg.rope_of``) too."""

    def __init__(self, cfg: DecoderConfig, *, layer_type: str, rngs: nnx.Rngs):
        hd = cfg.dim_per_head
        self.cfg = cfg
        self.layer_type = layer_type
        self.window = cfg.sliding_window if layer_type == "sliding_attention" else None
        self.q = Linear(cfg.hidden, cfg.heads * hd, bias=cfg.qkv_bias, rngs=rngs)
        self.k = Linear(cfg.hidden, cfg.kv_heads * hd, bias=cfg.qkv_bias, rngs=rngs)
        self.v = Linear(cfg.hidden, cfg.kv_heads * hd, bias=cfg.qkv_bias, rngs=rngs)
        self.o = Linear(cfg.heads * hd, cfg.hidden, bias=cfg.o_bias, rngs=rngs)
        self.sinks = (nnx.Param(_init_normal(rngs.params(), (cfg.heads,), jnp.float32)) if cfg.attention_sinks
                      else None)
        # q/k RMSNorm over each head's vector (width head_dim) or over all heads at once (``qk_norm_width``)
        per_head = cfg.qk_norm_width == "head"
        one = cfg.norm_unit_offset
        self.q_norm = RMSNorm(hd if per_head else cfg.heads * hd, cfg.norm_eps, one) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd if per_head else cfg.kv_heads * hd, cfg.norm_eps, one) if cfg.qk_norm else None

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array | None) -> jax.Array:
        cfg, hd = self.cfg, self.cfg.dim_per_head
        B, T, _ = x_BTD.shape
        q_BTQ, k_BTC = self.q(x_BTD), self.k(x_BTD)  # Q = N * H, C = K * H
        if self.q_norm is not None and cfg.qk_norm_width == "all_heads":
            q_BTQ, k_BTC = self.q_norm(q_BTQ), self.k_norm(k_BTC)
        q_BTNH = q_BTQ.reshape(B, T, cfg.heads, hd)
        k_BTKH = k_BTC.reshape(B, T, cfg.kv_heads, hd)
        v_BTKH = self.v(x_BTD).reshape(B, T, cfg.kv_heads, hd)
        if self.q_norm is not None and cfg.qk_norm_width == "head":
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        inv_freq = rope_frequencies(cfg, positions_BT, self.layer_type)
        rope_scaling = cfg.rope_of(self.layer_type)[1]
        scale = 1.0 if rope_scaling is None else rope_scaling.cos_sin_scale
        q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq, scale)
        k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq, scale)
        sinks_N = None if self.sinks is None else self.sinks[...]
        out_BTNH = attend(cfg, self.window, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, sinks_N)
        return self.o(out_BTNH.reshape(B, T, cfg.heads * hd))


class MLAttention(nnx.Module):
    """DeepSeek-V3's multi-head latent attention (``cfg.mla``, an ``MLAConfig``), as transformers'
    ``DeepseekV3Attention`` computes it. Parameters: ``q`` (no ``q_lora_rank``) or ``q_a``, ``q_a_norm``, ``q_b``;
    ``kv_a``, ``kv_a_norm``, ``kv_b``; ``o``. With ``cfg.qkv_bias`` (transformers' ``attention_bias``) q_a, kv_a
    and o have biases.

    The keys are expanded per head (no latent-space trick: this is training, every key is needed anyway) and the
    values, ``v_dim`` wide, are zero-padded to the query/key width for the attention kernels (which take one
    head width for q, k and v: the zeros add nothing to the output, whose padding is cut)."""

    def __init__(self, cfg: DecoderConfig, *, layer_type: str, rngs: nnx.Rngs):
        m, D, N = cfg.mla, cfg.hidden, cfg.heads
        self.cfg = cfg
        self.layer_type = layer_type
        bias = cfg.qkv_bias
        if m.q_lora_rank is None:
            self.q = Linear(D, N * m.qk_dim, rngs=rngs)
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            self.q = None
            self.q_a = Linear(D, m.q_lora_rank, bias=bias, rngs=rngs)
            self.q_a_norm = RMSNorm(m.q_lora_rank, m.latent_norm_eps)
            self.q_b = Linear(m.q_lora_rank, N * m.qk_dim, rngs=rngs)
        self.kv_a = Linear(D, m.kv_lora_rank + m.qk_rope_dim, bias=bias, rngs=rngs)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, m.latent_norm_eps)
        self.kv_b = Linear(m.kv_lora_rank, N * (m.qk_nope_dim + m.v_dim), rngs=rngs)
        self.o = Linear(N * m.v_dim, D, bias=bias, rngs=rngs)

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array | None) -> jax.Array:
        cfg, m = self.cfg, self.cfg.mla
        B, T, _ = x_BTD.shape
        N, nope, rope, vd = cfg.heads, m.qk_nope_dim, m.qk_rope_dim, m.v_dim
        q_BTQ = self.q(x_BTD) if self.q is not None else self.q_b(self.q_a_norm(self.q_a(x_BTD)))
        q_BTNH = q_BTQ.reshape(B, T, N, m.qk_dim)
        kv_BTC = self.kv_a(x_BTD)
        latent_BTL, k_rot_BT1R = kv_BTC[..., :m.kv_lora_rank], kv_BTC[..., m.kv_lora_rank:][:, :, None, :]
        kv_BTNW = self.kv_b(self.kv_a_norm(latent_BTL)).reshape(B, T, N, nope + vd)
        k_nope_BTNP, v_BTNV = kv_BTNW[..., :nope], kv_BTNW[..., nope:]
        q_nope_BTNP, q_rot_BTNR = q_BTNH[..., :nope], q_BTNH[..., nope:]
        if m.rope_interleave:  # pairs (x0, x1), (x2, x3), ...: as rotate-half of the evens then the odds
            q_rot_BTNR, k_rot_BT1R = _deinterleave(q_rot_BTNR), _deinterleave(k_rot_BT1R)
        inv_freq = rope_frequencies(cfg, positions_BT, self.layer_type)
        rope_scaling = cfg.rope_of(self.layer_type)[1]
        scale = 1.0 if rope_scaling is None else rope_scaling.cos_sin_scale
        q_rot_BTNR = apply_rope(q_rot_BTNR, positions_BT, inv_freq, scale)
        k_rot_BT1R = apply_rope(k_rot_BT1R, positions_BT, inv_freq, scale)
        q_BTNH = jnp.concatenate([q_nope_BTNP, q_rot_BTNR], axis=-1)
        k_BTNH = jnp.concatenate([k_nope_BTNP, jnp.broadcast_to(k_rot_BT1R, (B, T, N, rope))], axis=-1)
        width = max(m.qk_dim, vd)  # one head width for q, k and v: the narrower zero-padded
        pad = lambda x: x if x.shape[-1] == width else jnp.pad(x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),))  # noqa: E731
        out_BTNH = attend(cfg, None, pad(q_BTNH), pad(k_BTNH), pad(v_BTNV), segment_ids_BT)
        return self.o(out_BTNH[..., :vd].reshape(B, T, N * vd))


def _deinterleave(x: jax.Array) -> jax.Array:
    """The even dimensions of the last axis, then the odd ones."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLP(nnx.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``; ``activation`` "silu" (SwiGLU) or "gelu_tanh"
    (GeGLU with GELU's tanh approximation, transformers' "gelu_pytorch_tanh")."""

    def __init__(self, hidden: int, ffn: int, *, activation: str = "silu", rngs: nnx.Rngs):
        self.gate = Linear(hidden, ffn, rngs=rngs)
        self.up = Linear(hidden, ffn, rngs=rngs)
        self.down = Linear(ffn, hidden, rngs=rngs)
        self.activation = activation

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        g = self.gate(x_BTD)
        act = jax.nn.silu(g) if self.activation == "silu" else jax.nn.gelu(g, approximate=True)
        return self.down(act * self.up(x_BTD))
