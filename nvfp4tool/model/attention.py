"""Attention: which keys each query may see (`AttentionMask`), and the attention math (`attend`,
through `jax.nn.dot_product_attention`) on the implementation `attention_implementation` picks.

Masks are causal (no [B, T, S] array) or explicit (`attention_allowed`); each attention layer
narrows the model's mask to its own sliding window (`AttentionMask.within`: its family's setting);
"cudnn" (flash attention) where it applies, else "xla": the same attention up to fp32 summation order.
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.extend
import jax.numpy as jnp

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_CUDNN_MAX_HEAD_DIM = 128  # jax's check: <= 128 before Hopper, <= 256 from Hopper (sm90) on
_CUDNN_HEAD_DIM_MULTIPLE = 8


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["allowed_BxTxS", "tokens_BxT", "segments_BxT", "query_positions_BxT", "key_positions_BxS"],
    meta_fields=["window"],
)
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may see: build with `causal(window)` or `explicit(allowed_BxTxS)`.
    A pytree (the arrays leaves, the window static), so it passes through jit, scan and checkpoint.
    `tokens_BxT` (explicit masks of padded rows): which of this chunk's slots hold tokens, and
    `segments_BxT` (packed rows): which document each slot belongs to, for the mixers that read
    the sequence without attending (a Mamba layer zeroes padding and restarts at each document).
    `query_positions_BxT` / `key_positions_BxS` (explicit masks): the positions a layer's sliding
    window is measured in (`within`)."""

    allowed_BxTxS: jax.Array | None  # explicit: True = may see; None: causal
    window: int | None = None  # causal only: keys at distance < window (None: unbounded)
    tokens_BxT: jax.Array | None = None  # this chunk's real tokens (None: every slot is one)
    segments_BxT: jax.Array | None = None  # this chunk's document ids, 0 = padding (None: one stream)
    query_positions_BxT: jax.Array | None = None  # explicit: each query's position
    key_positions_BxS: jax.Array | None = None  # explicit: each key slot's position

    @classmethod
    def causal(cls, window: int | None = None) -> AttentionMask:
        """Causal over unpadded rows with no cache (T = S), within a sliding window if given."""
        return cls(None, window)

    @classmethod
    def explicit(
        cls,
        allowed_BxTxS: jax.Array,
        tokens_BxT: jax.Array | None = None,
        segments_BxT: jax.Array | None = None,
        *,
        query_positions_BxT: jax.Array | None = None,
        key_positions_BxS: jax.Array | None = None,
    ) -> AttentionMask:
        """An explicit [B, T, S] bool mask (`attention_allowed`), which slots hold tokens,
        (packed rows) their document ids and the positions of queries and keys (a windowed layer
        needs them)."""
        return cls(allowed_BxTxS, None, tokens_BxT, segments_BxT, query_positions_BxT, key_positions_BxS)

    def within(self, window: int | None) -> AttentionMask:
        """This mask for a layer with sliding window `window` (None: itself): causal, the window
        given to the kernel; explicit, keys whose position is `window` or more before the query's
        masked (`window_allowed`)."""
        if window is None:
            return self
        if self.allowed_BxTxS is None:
            return dataclasses.replace(self, window=window)
        if self.query_positions_BxT is None or self.key_positions_BxS is None:
            raise ValueError("an explicit mask needs the query and key positions for a sliding-window layer")
        allowed_BxTxS = self.allowed_BxTxS & window_allowed(self.query_positions_BxT, self.key_positions_BxS, window)
        return dataclasses.replace(self, allowed_BxTxS=allowed_BxTxS)

    @property
    def kind(self) -> str:
        return "explicit" if self.allowed_BxTxS is not None else "causal"


def attend(
    q_BxTxHxD: jax.Array,
    k_BxSxKVxD: jax.Array,
    v_BxSxKVxD: jax.Array,
    mask: AttentionMask,
    scale: float | None = None,
) -> jax.Array:
    """softmax(q k^T * scale, masked by `mask`) v: [B, T, H, D] in q's dtype (query head h uses
    kv head h // (H / KV); `scale` None: 1 / sqrt(D)); k and v must have q's dtype.

    XLA: scores and softmax in fp32, the probabilities cast to v's dtype; masked scores get a large
    finite negative, so a fully masked (padding) query row of an explicit mask is the mean of v
    rather than NaN. cuDNN: the same math in one fused kernel (online softmax in fp32).
    """
    implementation = attention_implementation(
        _platform(), q_BxTxHxD.dtype, q_BxTxHxD.shape[-1], q_BxTxHxD.shape[1], mask.kind
    )
    scale = q_BxTxHxD.shape[-1] ** -0.5 if scale is None else scale
    if mask.allowed_BxTxS is not None:
        return jax.nn.dot_product_attention(
            q_BxTxHxD,
            k_BxSxKVxD,
            v_BxSxKVxD,
            mask=mask.allowed_BxTxS[:, None],
            scale=scale,
            implementation=implementation,
        )
    window = None if mask.window is None else (mask.window - 1, 0)  # (keys before, keys after)
    return jax.nn.dot_product_attention(
        q_BxTxHxD,
        k_BxSxKVxD,
        v_BxSxKVxD,
        scale=scale,
        is_causal=True,
        local_window_size=window,
        implementation=implementation,
    )


def attention_implementation(platform: str, dtype: jnp.dtype, head_dim: int, seq_len: int, mask_kind: str) -> str:
    """ "cudnn" on a CUDA GPU for a causal mask over an even `seq_len`, bf16/fp16 q/k/v and a head
    dim cuDNN's flash kernel takes (a multiple of 8, <= 128); "xla" otherwise (the CPU, fp32, an
    explicit mask)."""
    cudnn = (
        platform == "cuda"
        and mask_kind == "causal"
        and jnp.dtype(dtype) in _CUDNN_DTYPES
        and head_dim % _CUDNN_HEAD_DIM_MULTIPLE == 0
        and head_dim <= _CUDNN_MAX_HEAD_DIM
        and seq_len % 2 == 0
    )
    return "cudnn" if cudnn else "xla"


def attention_allowed(
    query_index_T: jax.Array,
    key_valid_BxS: jax.Array,
    sliding_window: int | None,
    query_positions_BxT: jax.Array | None = None,
    key_positions_BxS: jax.Array | None = None,
    query_segments_BxT: jax.Array | None = None,
    key_segments_BxS: jax.Array | None = None,
) -> jax.Array:
    """[B, T, S] bool: query at sequence slot q may see the key in slot k iff k <= q and slot k is
    not padding, (sliding window W) the key's position is within W - 1 of the query's, and
    (segments given: packed documents) the key is in the query's document.

    The window is measured in positions (positions needed only then): for unpadded and
    left-padded rows that equals HF's slot distance; for right-padded rows continued by
    `generate` it keeps the padding from eating into the window; in packed rows the positions
    restart at each document, and within one document their distance is the slots'.
    """
    key_index_S = jnp.arange(key_valid_BxS.shape[-1])
    allowed_BxTxS = (key_index_S[None, :] <= query_index_T[:, None])[None] & key_valid_BxS[:, None, :].astype(bool)
    if sliding_window is not None:
        allowed_BxTxS &= window_allowed(query_positions_BxT, key_positions_BxS, sliding_window)
    if query_segments_BxT is not None:
        allowed_BxTxS &= query_segments_BxT[:, :, None] == key_segments_BxS[:, None, :]
    return allowed_BxTxS


def window_allowed(query_positions_BxT: jax.Array, key_positions_BxS: jax.Array, window: int) -> jax.Array:
    """[B, T, S] bool: the key's position is within `window` - 1 of the query's."""
    return query_positions_BxT[:, :, None] - key_positions_BxS[:, None, :] < window


def _platform() -> str:
    """The default backend: "cuda" for an NVIDIA GPU (jax names CUDA and ROCm GPUs both "gpu")."""
    backend = jax.extend.backend.get_backend()
    return "cuda" if "cuda" in backend.platform_version.lower() else backend.platform
