"""The Mamba-2 mixer of the hybrid Nemotron-H family (reference sheet section 12), between its two
linears: `in_proj`'s output in, `out_proj`'s input out, so both linears stay on the linear seam
(quantized like any other) and everything here runs in higher precision (the SSM in fp32).

    block = Mamba2Mixer(hidden, shape, prefix="model.layers.0.mixer", ...)   # the Flax module
    y_BxTxE, state, side = block(x_BxTxE, seam, mask_BxT=mask)              # in_proj, mixer, out_proj

Design notes: docs/design/model.md.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.families import Projection
from nvfp4tool.families.nemotron_h import MAMBA_IN, MAMBA_OUT
from nvfp4tool.model.layers import Linear
from nvfp4tool.model.linear import Seam, Side, merged


@dataclasses.dataclass(frozen=True)
class MambaShape:
    """The mixer's sizes (from the config: mamba_num_heads, mamba_head_dim, n_groups,
    ssm_state_size, conv_kernel, chunk_size, time_step_limit, layer_norm_epsilon)."""

    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    chunk: int
    dt_limit: tuple[float, float] = (0.0, math.inf)
    eps: float = 1e-5

    @property
    def inner(self) -> int:
        """I = heads x head_dim: the width of x, z and out_proj's input."""
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The conv1d's channels: x | B | C."""
        return self.inner + 2 * self.groups * self.state

    @property
    def in_proj_rows(self) -> int:
        """in_proj's output features: z | x | B | C | dt."""
        return self.inner + self.conv_dim + self.heads

    def pieces(self) -> tuple[tuple[str, int], ...]:
        """in_proj's row blocks in order, (name, rows): what vLLM shards separately."""
        gn = self.groups * self.state
        return (("z", self.inner), ("x", self.inner), ("B", gn), ("C", gn), ("dt", self.heads))


@partial(jax.tree_util.register_dataclass, data_fields=["conv_BxKxC", "ssm_BxHxPxN"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MambaState:
    """A Mamba layer's decode state: the last K - 1 conv inputs and the SSM state, fp32."""

    conv_BxKxC: jax.Array  # [B, K - 1, conv_dim]
    ssm_BxHxPxN: jax.Array  # [B, heads, head_dim, state]

    @classmethod
    def zeros(cls, batch: int, shape: MambaShape) -> MambaState:
        return cls(
            jnp.zeros((batch, shape.conv_kernel - 1, shape.conv_dim), jnp.float32),
            jnp.zeros((batch, shape.heads, shape.head_dim, shape.state), jnp.float32),
        )


def causal_conv(
    xbc_BxTxC: jax.Array,
    weight_CxK: jax.Array,
    bias_C: jax.Array | None,
    past_BxKxC: jax.Array,
    segments_BxT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The depthwise causal conv1d then SiLU, fp32: out[t] = silu(sum_k w[:, k] x[t - (K-1) + k]
    + b), the K - 1 inputs before the first taken from `past` (zeros at a sequence start); the
    output and the new past (the last K - 1 inputs). With `segments_BxT` (packed documents) an
    input of another segment than t's reads as zero, as the zeros before a sequence start (the
    past counts as the first position's segment)."""
    k = weight_CxK.shape[1]
    t = xbc_BxTxC.shape[1]
    window = jnp.concatenate([past_BxKxC, xbc_BxTxC.astype(jnp.float32)], axis=1)  # [B, K - 1 + T, C]
    w = weight_CxK.astype(jnp.float32)
    taps = [window[:, j : j + t, :] for j in range(k)]
    if segments_BxT is not None:
        past_segments = jnp.repeat(segments_BxT[:, :1], k - 1, axis=1)
        window_segments = jnp.concatenate([past_segments, segments_BxT], axis=1)  # [B, K - 1 + T]
        taps = [
            jnp.where((window_segments[:, j : j + t] == segments_BxT)[..., None], tap, 0.0)
            for j, tap in enumerate(taps)
        ]
    out = sum(tap * w[:, j] for j, tap in enumerate(taps))
    if bias_C is not None:
        out = out + bias_C.astype(jnp.float32)
    return jax.nn.silu(out), window[:, t:, :]


def _segsum(a_XxL: jax.Array) -> jax.Array:
    """[..., L] -> [..., L, L]: entry [l, s] = sum of a over (s, l] for s <= l, -inf above the
    diagonal; summed as masked cumulative sums (no difference of two large cumsums)."""
    length = a_XxL.shape[-1]
    below = jnp.tril(jnp.ones((length, length), bool), -1)
    segments = jnp.cumsum(jnp.where(below, a_XxL[..., :, None], 0.0), axis=-2)  # [..., l, s]
    return jnp.where(jnp.tril(jnp.ones((length, length), bool)), segments, -jnp.inf)


def ssd_chunked(
    x_BxTxHxP: jax.Array,
    dt_BxTxH: jax.Array,
    a_H: jax.Array,
    b_BxTxGxN: jax.Array,
    c_BxTxGxN: jax.Array,
    chunk: int,
    h0_BxHxPxN: jax.Array,
    segments_BxT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence of the module docstring (without D) as the chunked SSD scan, fp32: inside
    each chunk of `chunk` positions the exact quadratic form, between chunks the recurrence on the
    chunk-boundary states. dt is the final step size (after softplus and limit). The sequence is
    padded at the end to whole chunks (dt = 0 there: no decay, no input). (y [B, T, H, P], final
    state). With `segments_BxT` (packed documents, Mamba-2's `seq_idx`) the state restarts from
    zero at each segment: every decay across a segment change is 0 (`_cut_at_segments`); `h0`
    continues the first position's segment."""
    bsz, t, h, p = x_BxTxHxP.shape
    rep = h // b_BxTxGxN.shape[2]
    f32 = jnp.float32
    dt = dt_BxTxH.astype(f32)
    xdt = x_BxTxHxP.astype(f32) * dt[..., None]
    adt = a_H.astype(f32) * dt  # [B, T, H]
    bh = jnp.repeat(b_BxTxGxN.astype(f32), rep, axis=2)
    ch = jnp.repeat(c_BxTxGxN.astype(f32), rep, axis=2)
    pad = (-t) % chunk

    def chunks(v):
        v = jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
        return v.reshape(bsz, -1, chunk, *v.shape[2:])

    xdt, adt, bh, ch = map(chunks, (xdt, adt, bh, ch))  # [B, nc, L, ...]
    a_cum = jnp.cumsum(adt, axis=2)  # [B, nc, L, H]
    decay_LxS = jnp.exp(_segsum(jnp.moveaxis(adt, 2, -1)))  # [B, nc, H, L, S]
    to_end = jnp.exp(a_cum[:, :, -1:, :] - a_cum)  # [B, nc, L, H]: decay from l to the chunk's end
    chunk_decay = jnp.exp(a_cum[:, :, -1, :])  # [B, nc, H]
    from_start = jnp.exp(a_cum)  # [B, nc, L, H]: decay from the chunk's start to l
    if segments_BxT is not None:
        # the padded end continues the last segment (dt = 0 there: it changes no state)
        segments = jnp.pad(segments_BxT, [(0, 0), (0, pad)], mode="edge").reshape(bsz, -1, chunk)
        decay_LxS, to_end, chunk_decay, from_start = _cut_at_segments(
            segments, decay_LxS, to_end, chunk_decay, from_start
        )
    scores = jnp.einsum("bclhn,bcshn->bchls", ch, bh) * decay_LxS
    y_diag = jnp.einsum("bchls,bcshp->bclhp", scores, xdt)
    chunk_states = jnp.einsum("bclhn,bclh,bclhp->bchpn", bh, to_end, xdt)

    def carry(state, inputs):
        decay_BxH, add_BxHxPxN = inputs
        return decay_BxH[..., None, None] * state + add_BxHxPxN, state  # emit the chunk's start state

    final, starts = jax.lax.scan(
        carry, h0_BxHxPxN.astype(f32), (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(chunk_states, 1, 0))
    )
    starts = jnp.moveaxis(starts, 0, 1)  # [B, nc, H, P, N]
    y_off = jnp.einsum("bclhn,bchpn->bclhp", ch, starts) * from_start[..., None]
    y = (y_diag + y_off).reshape(bsz, -1, h, p)[:, :t]
    return y, final


def _cut_at_segments(segments_BxCxL, decay_BxCxHxLxS, to_end_BxCxLxH, chunk_decay_BxCxH, from_start_BxCxLxH):
    """The chunked scan's decays with every path across a segment change cut (Mamba-2's
    `seq_idx`): inside a chunk, position s reaches l only in l's segment; a position adds to the
    chunk's end state only in the chunk end's segment; the state entering a chunk (the previous
    chunk end's segment; the first chunk's: its first position's) carries on through the chunk
    only when the chunk ends in that segment, and reaches the positions of that segment only."""
    same_LxS = segments_BxCxL[:, :, :, None] == segments_BxCxL[:, :, None, :]  # [B, nc, L, S]
    end_BxC = segments_BxCxL[:, :, -1]
    entering_BxC = jnp.concatenate([segments_BxCxL[:, :1, 0], end_BxC[:, :-1]], axis=1)  # the state's segment
    return (
        jnp.where(same_LxS[:, :, None], decay_BxCxHxLxS, 0.0),
        jnp.where((segments_BxCxL == end_BxC[..., None])[..., None], to_end_BxCxLxH, 0.0),
        jnp.where((end_BxC == entering_BxC)[..., None], chunk_decay_BxCxH, 0.0),
        jnp.where((segments_BxCxL == entering_BxC[..., None])[..., None], from_start_BxCxLxH, 0.0),
    )


def ssd_recurrent(
    x_BxTxHxP: jax.Array,
    dt_BxTxH: jax.Array,
    a_H: jax.Array,
    b_BxTxGxN: jax.Array,
    c_BxTxGxN: jax.Array,
    h0_BxHxPxN: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The same recurrence one position at a time (decode; `ssd_chunked`'s cross-check), fp32."""
    rep = x_BxTxHxP.shape[2] // b_BxTxGxN.shape[2]
    f32 = jnp.float32

    def step(state, inputs):
        x_BxHxP, dt_BxH, b_BxGxN, c_BxGxN = inputs
        bh = jnp.repeat(b_BxGxN, rep, axis=1)
        ch = jnp.repeat(c_BxGxN, rep, axis=1)
        state = (
            jnp.exp(dt_BxH * a_H.astype(f32))[..., None, None] * state
            + (dt_BxH[..., None] * x_BxHxP)[..., None] * bh[:, :, None, :]
        )
        return state, jnp.einsum("bhpn,bhn->bhp", state, ch)

    inputs = tuple(jnp.moveaxis(v.astype(f32), 1, 0) for v in (x_BxTxHxP, dt_BxTxH, b_BxTxGxN, c_BxTxGxN))
    final, y = jax.lax.scan(step, h0_BxHxPxN.astype(f32), inputs)
    return jnp.moveaxis(y, 0, 1), final


def gated_rms_norm(y_BxTxI: jax.Array, z_BxTxI: jax.Array, weight_I: jax.Array, groups: int, eps: float) -> jax.Array:
    """y * silu(z), RMS-normalised over each of `groups` equal slices of the channels, times the
    weight, all in fp32 (the norm before out_proj)."""
    f32 = jnp.float32
    g = y_BxTxI.astype(f32) * jax.nn.silu(z_BxTxI.astype(f32))
    split = g.reshape(*g.shape[:-1], groups, -1)
    split = split * jax.lax.rsqrt(jnp.mean(split * split, axis=-1, keepdims=True) + eps)
    return weight_I.astype(f32) * split.reshape(g.shape)


def step_size(dt_BxTxH: jax.Array, dt_bias_H: jax.Array, dt_limit: tuple[float, float]) -> jax.Array:
    """dt = softplus(dt + dt_bias), limited to `dt_limit` (no-op for (0, inf)), fp32."""
    dt = jax.nn.softplus(dt_BxTxH.astype(jnp.float32) + dt_bias_H.astype(jnp.float32))
    low, high = dt_limit
    if low > 0.0 or high < math.inf:
        dt = jnp.clip(dt, low, high)
    return dt


def mixer(
    zxbcdt_BxTxF: jax.Array,
    params: dict[str, jax.Array],
    shape: MambaShape,
    *,
    mask_BxT: jax.Array | None = None,
    segments_BxT: jax.Array | None = None,
    state: MambaState | None = None,
    dtype=jnp.float32,
) -> tuple[jax.Array, MambaState]:
    """in_proj's output -> out_proj's input (in `dtype`) and the decode state after the last
    position. `params`: conv1d_weight [C, K] (the stored [C, 1, K] squeezed), conv1d_bias [C] or
    absent, dt_bias, A_log, D [H], norm_weight [I]. With `state`, continues from it (a decode
    step of one position runs the recurrence, longer inputs the chunked scan); without, starts
    from zeros. `segments_BxT` (packed documents): the conv and the scan restart at each segment,
    as if each document ran alone (the state returned is then the last segment's)."""
    bsz, t, _ = zxbcdt_BxTxF.shape
    i, gn, h, p = shape.inner, shape.groups * shape.state, shape.heads, shape.head_dim
    if state is None:
        state = MambaState.zeros(bsz, shape)
    z = zxbcdt_BxTxF[..., :i]
    xbc = zxbcdt_BxTxF[..., i : i + shape.conv_dim]
    dt_raw = zxbcdt_BxTxF[..., i + shape.conv_dim :]
    xbc, conv_past = causal_conv(
        xbc, params["conv1d_weight"], params.get("conv1d_bias"), state.conv_BxKxC, segments_BxT
    )
    if mask_BxT is not None:
        xbc = xbc * mask_BxT[..., None].astype(xbc.dtype)
    x = xbc[..., :i].reshape(bsz, t, h, p)
    b = xbc[..., i : i + gn].reshape(bsz, t, shape.groups, shape.state)
    c = xbc[..., i + gn :].reshape(bsz, t, shape.groups, shape.state)
    dt = step_size(dt_raw, params["dt_bias"], shape.dt_limit)
    a = -jnp.exp(params["A_log"].astype(jnp.float32))
    if t == 1:
        y, ssm = ssd_recurrent(x, dt, a, b, c, state.ssm_BxHxPxN)
    else:
        y, ssm = ssd_chunked(x, dt, a, b, c, shape.chunk, state.ssm_BxHxPxN, segments_BxT)
    y = y + params["D"].astype(jnp.float32)[:, None] * x
    out = gated_rms_norm(y.reshape(bsz, t, i), z, params["norm_weight"], shape.groups, shape.eps)
    return out.astype(dtype), MambaState(conv_past, ssm)


class _Conv1d(nnx.Module):
    """The depthwise conv's parameters as HF stores them: weight [C, 1, K], bias [C]."""

    def __init__(self, channels: int, kernel: int, *, bias: bool, param_dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        bound = 1.0 / math.sqrt(kernel)  # PyTorch's Conv1d default for one input channel per group
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (channels, 1, kernel), param_dtype, -bound, bound))
        self.bias = nnx.Param(jnp.zeros((channels,), param_dtype)) if bias else None


class _GatedNorm(nnx.Module):
    def __init__(self, dim: int, *, param_dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))


class Mamba2Mixer(nnx.Module):
    """A Mamba layer's mixer with its HF attributes (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
    `norm`, `out_proj`, under `prefix`): in_proj and out_proj through the linear seam (the only
    GEMMs a recipe quantizes), the rest in fp32 as `mixer`. The initial values are transformers'
    (A = 1..heads, D = 1, dt_bias = 1); the parameters of a loaded checkpoint replace them."""

    def __init__(
        self,
        hidden: int,
        shape: MambaShape,
        *,
        prefix: str,
        use_bias: bool,
        conv_bias: bool,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        self.shape = shape

        def linear(p: Projection, k: int, n: int) -> Linear:  # under HF's attribute, the family's `p.attr`
            return Linear(k, n, bias=use_bias, name=f"{prefix}.{p.attr}", param_dtype=param_dtype, rngs=rngs)

        setattr(self, MAMBA_IN.attr, linear(MAMBA_IN, hidden, shape.in_proj_rows))
        self.conv1d = _Conv1d(shape.conv_dim, shape.conv_kernel, bias=conv_bias, param_dtype=param_dtype, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.ones((shape.heads,), param_dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, shape.heads + 1, dtype=jnp.float32)).astype(param_dtype))
        self.D = nnx.Param(jnp.ones((shape.heads,), param_dtype))
        self.norm = _GatedNorm(shape.inner, param_dtype=param_dtype)
        setattr(self, MAMBA_OUT.attr, linear(MAMBA_OUT, shape.inner, hidden))

    def __call__(
        self,
        x_BxTxE: jax.Array,
        seam: Seam,
        *,
        mask_BxT: jax.Array | None = None,
        segments_BxT: jax.Array | None = None,
        state: MambaState | None = None,
    ) -> tuple[jax.Array, MambaState, Side]:
        """(y [B, T, E] in x's dtype, the decode state after the last position, the seam's records)."""
        if mask_BxT is not None:
            x_BxTxE = x_BxTxE * mask_BxT[..., None].astype(x_BxTxE.dtype)
        zxbcdt, in_side = getattr(self, MAMBA_IN.attr)(x_BxTxE, seam)
        params = {
            "conv1d_weight": self.conv1d.weight[...][:, 0, :],
            "dt_bias": self.dt_bias[...],
            "A_log": self.A_log[...],
            "D": self.D[...],
            "norm_weight": self.norm.weight[...],
        }
        if self.conv1d.bias is not None:
            params["conv1d_bias"] = self.conv1d.bias[...]
        y, state = mixer(
            zxbcdt, params, self.shape, mask_BxT=mask_BxT, segments_BxT=segments_BxT, state=state, dtype=x_BxTxE.dtype
        )
        out, out_side = getattr(self, MAMBA_OUT.attr)(y, seam)
        return out, state, merged(in_side, out_side)
