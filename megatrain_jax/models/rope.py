"""RoPE: the inverse frequencies a layer rotates by (scaled as ``RopeScaling`` says, computed as Hugging Face
does) and the rotate-half rotation itself."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.models.config import DecoderConfig
from megatrain_jax.models.sublayers import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, long: bool = False) -> np.ndarray:
    """RoPE inverse frequencies [H/2] (``head_dim`` H: the rotated dimensions), scaled as ``scaling`` says
    (``RopeScaling``: llama3, linear, yarn, longrope), computed as Hugging Face does. ``long`` picks
    LongRoPE's long factors (the short ones otherwise; other kinds have one set)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv = 1.0 / theta ** exponents
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.kind == "linear":
        return (inv / scaling.factor).astype(np.float32)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, inv)
    if scaling.kind == "longrope":
        return (inv / np.asarray(scaling.long_factor if long else scaling.short_factor, np.float64)).astype(np.float32)
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def rope_frequencies(cfg: DecoderConfig, positions_BT: jax.Array,
                     layer_type: str = "full_attention") -> jax.Array | np.ndarray:
    """The inverse frequencies [rotary_dim / 2] a layer of type ``layer_type`` rotates ``positions_BT`` by
    (``cfg.rope_of``). LongRoPE takes its long factors when the largest position + 1 exceeds the original
    length (as transformers decides for each forward pass), its short ones otherwise: a choice made on the
    device, no host sync."""
    theta, s = cfg.rope_of(layer_type)
    inv = rope_inv_freq(cfg.rotary_dim, theta, s)
    if s is None or s.kind != "longrope":
        return inv
    long = rope_inv_freq(cfg.rotary_dim, theta, s, long=True)
    return jnp.where(jnp.max(positions_BT) + 1 > s.original_max_position, jnp.asarray(long), jnp.asarray(inv))


def _yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling, extrapolated: np.ndarray) -> np.ndarray:
    """YaRN: dimensions turning fewer than ``beta_slow`` times over the original length are interpolated
    (divided by ``factor``), more than ``beta_fast`` times kept, with a linear ramp between."""
    def dim_for(rotations: float) -> float:  # the dimension that turns ``rotations`` times
        return head_dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(s.beta_fast), dim_for(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    inv = extrapolated / s.factor * (1 - keep) + extrapolated * keep
    return inv.astype(np.float32)


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray | jax.Array,
               scale: float = 1.0) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face convention), computed in float32, on the first ``2 * len(inv_freq)``
    dimensions of each head (all of them unless ``partial_rotary_factor``); the rest pass unchanged. cos and
    sin are multiplied by ``scale`` (YaRN's and LongRoPE's attention factor)."""
    rotary = 2 * inv_freq.shape[0]
    if rotary < x_BTNH.shape[-1]:
        rotated = apply_rope(x_BTNH[..., :rotary], positions_BT, inv_freq, scale)
        return jnp.concatenate([rotated, x_BTNH[..., rotary:]], axis=-1)
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos = jnp.concatenate([jnp.cos(angles_BTh)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles_BTh)] * 2, axis=-1)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    x32 = x_BTNH.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x_BTNH.dtype)
