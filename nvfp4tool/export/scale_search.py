"""Quantize one weight [N, K] for export, by RTN or a per-block scale search, row chunk by chunk.

    q, err = quantize_weight(w_NxK, method="4over6", block="1d", global_amax=group_amax)

Methods "rtn", "4over6" and "mse"; the output is always a plain NVFP4 tensor that every engine decodes.
Peak memory: the input plus one chunk of about `CHUNK_ELEMENTS` fp32 temporaries.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool import numerics
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import NVFP4Array
from nvfp4tool.numerics.blocks import flush_subnormal
from nvfp4tool.numerics.constants import E4M3_MAX_CODE, NVFP4_BLOCK

METHODS = ("rtn", "4over6", "mse")
CHUNK_ELEMENTS = 1 << 22  # ~4M elements (16 MiB fp32) per jitted step
FOUR_OVER_SIX_AMAX_FACTOR = np.float32(1.75)  # 2688 / 1536: global E4M3 bound 448 -> 256
FOUR_OVER_SIX_TARGETS = (6.0, 4.0)  # the block amax maps to 6 (standard) or to 4


@dataclasses.dataclass(frozen=True)
class WeightError:
    """Relative L2 error ||dequant(q) - w|| / ||w|| of the export, and of RTN for comparison."""

    rel_l2: float
    rtn_rel_l2: float
    decoded_amax: float = 0.0  # max |dequant(q)|: what the stored bytes decode to (export records it)

    @property
    def reduction_vs_rtn(self) -> float:
        """1 - err / err_rtn (0 for RTN itself; > 0 when the search helped)."""
        return 0.0 if self.rtn_rel_l2 == 0 else 1.0 - self.rel_l2 / self.rtn_rel_l2


def quantize_weight(
    w_NxK: np.ndarray | jax.Array,
    *,
    method: str = "rtn",
    block: str = "1d",
    global_amax: float,
    mse_radius: int = 2,
    name: str = "weight",
) -> tuple[NVFP4Array, WeightError]:
    """NVFP4 of `w_NxK` along K against `global_amax` (the tensor's or its fused group's amax).

    Returns the record (numpy packed/scales) and its weight error. The caller checked finiteness.
    """
    if method not in METHODS:
        raise NVFP4ToolError(f"unknown scale search {method!r}; choose one of {', '.join(METHODS)}")
    if block not in ("1d", "2d"):
        raise NVFP4ToolError(f"tensor '{name}': block must be '1d' or '2d', got {block!r}")
    w_NxK = np.asarray(w_NxK)
    if w_NxK.ndim != 2 or w_NxK.shape[1] % NVFP4_BLOCK != 0:
        raise NVFP4ToolError(
            f"tensor '{name}' shape {tuple(w_NxK.shape)}: expected [N, K] with K a multiple of {NVFP4_BLOCK}"
        )
    n, k = w_NxK.shape
    gamax = np.float32(global_amax)
    record_amax = np.float32(gamax * FOUR_OVER_SIX_AMAX_FACTOR) if method == "4over6" else gamax
    rows = max(NVFP4_BLOCK, (CHUNK_ELEMENTS // k) // NVFP4_BLOCK * NVFP4_BLOCK)
    rows = min(rows, -(-n // NVFP4_BLOCK) * NVFP4_BLOCK)
    packed = np.empty((n, k // 2), np.uint8)
    scales = np.empty((n, k // NVFP4_BLOCK), jnp.float8_e4m3fn)
    sums = np.zeros(3, np.float64)  # sum err^2, sum rtn_err^2, sum w^2
    peak = np.float32(0.0)  # max |dequant(q)| (zero padding rows decode to zero)
    offsets = _offsets(method, mse_radius)
    for start in range(0, n, rows):
        chunk = w_NxK[start : start + rows]
        if chunk.shape[0] < rows:  # pad with zero rows: same compiled shape, tile maxima unchanged
            chunk = np.concatenate([chunk, np.zeros((rows - chunk.shape[0], k), chunk.dtype)])
        p, s, chunk_sums, chunk_peak = _quantize_chunk(
            jnp.asarray(chunk), gamax, record_amax, method=method, block=block, offsets=offsets
        )
        stop = min(start + rows, n)
        packed[start:stop] = np.asarray(p)[: stop - start]
        scales[start:stop] = np.asarray(s)[: stop - start]
        sums += np.asarray(chunk_sums, np.float64)
        peak = max(peak, np.float32(chunk_peak))
    norm = float(np.sqrt(sums[2]))
    error = WeightError(
        rel_l2=float(np.sqrt(sums[0])) / norm if norm else 0.0,
        rtn_rel_l2=float(np.sqrt(sums[1])) / norm if norm else 0.0,
        decoded_amax=float(peak),
    )
    record = NVFP4Array(
        packed=packed,
        scales=scales,
        global_amax=np.float32(record_amax),
        shape=(n, k),
        dtype=np.dtype(w_NxK.dtype),
        axis=1,
        block=block,
    )
    return record, error


def slice_scales(x_NxK: jax.Array, gamax, record_amax, *, method: str, block: str, mse_radius: int = 2) -> jax.Array:
    """The E4M3 block scales [N, K/16] that `quantize_weight` chooses for `x_NxK` (fp32, traced:
    GPTQ's scales of a 16-column slice as it has updated the weights so far). `record_amax` is the
    record's global amax (4over6's fl(1.75 * amax), else `gamax`). Rows are padded with zeros to
    whole tiles, which leaves every tile maximum unchanged."""
    n = x_NxK.shape[0]
    x = jnp.pad(x_NxK, ((0, -n % NVFP4_BLOCK), (0, 0)))
    return _quantize_chunk(x, gamax, record_amax, method=method, block=block, offsets=_offsets(method, mse_radius))[1][
        :n
    ]


# ------------------------------------------------------------------------------------------
# helpers


def _offsets(method: str, mse_radius: int) -> tuple[int, ...]:
    """The E4M3 code offsets "mse" tries around the RTN scale (none for the other methods)."""
    return tuple(range(-mse_radius, mse_radius + 1)) if method == "mse" else ()


@functools.partial(jax.jit, static_argnames=("method", "block", "offsets"))
def _quantize_chunk(x_RxK, gamax, record_amax, *, method, block, offsets):
    """(packed, scales, [sum err^2, sum rtn err^2, sum x^2], max |dequant|) of one row chunk."""
    x32 = flush_subnormal(x_RxK.astype(jnp.float32))
    rtn = numerics.quantize_nvfp4(x_RxK, block=block, global_amax=gamax)
    rtn_deq = numerics.dequantize_nvfp4(rtn)
    rtn_err = jnp.sum(jnp.square(rtn_deq - x32))
    norm = jnp.sum(jnp.square(x32))
    if method == "rtn":
        return rtn.packed, rtn.scales, jnp.stack([rtn_err, rtn_err, norm]), jnp.max(jnp.abs(rtn_deq))
    s_enc, s_dec = numerics.nvfp4_global_scales(record_amax)
    x_Bx16 = x32.reshape(*x32.shape[:-1], -1, NVFP4_BLOCK)
    if method == "4over6":
        bamax = numerics.nvfp4_block_amax(x32, block)
        candidates = [numerics.nvfp4_block_scales(bamax, s_enc, block_max=target) for target in FOUR_OVER_SIX_TARGETS]
    else:  # mse: neighbouring E4M3 codes of the RTN scale (positive codes are ordered)
        codes = jax.lax.bitcast_convert_type(rtn.scales, jnp.uint8).astype(jnp.int32)
        candidates = [
            jax.lax.bitcast_convert_type(jnp.clip(codes + d, 0, E4M3_MAX_CODE).astype(jnp.uint8), jnp.float8_e4m3fn)
            for d in sorted(offsets, key=abs)
        ]  # offset 0 first: RTN wins ties
    best_scale = best_codes = best_err = best_peak = None
    for scale in candidates:
        codes, err, peak = _encode_with_scale(x_Bx16, scale, s_dec, block)
        if best_err is None:
            best_scale, best_codes, best_err, best_peak = scale, codes, err, peak
        else:
            better = err < best_err
            best_scale = jnp.where(better, scale, best_scale)
            best_codes = jnp.where(better[..., None], codes, best_codes)
            best_err = jnp.where(better, err, best_err)
            best_peak = jnp.where(better, peak, best_peak)
    packed = numerics.pack_codes(best_codes.reshape(x32.shape))
    total = jnp.sum(best_err) / (NVFP4_BLOCK if block == "2d" else 1)  # 2d: tile error repeated
    return packed, best_scale, jnp.stack([total, rtn_err, norm]), jnp.max(best_peak)


def _encode_with_scale(x_Bx16, scale, s_dec, block: str):
    """(E2M1 codes [R, K/16, 16], squared error per block or per tile, max |decoded| per block)
    with the given scales, by the numerics' own encoder and decode product."""
    codes, values = numerics.encode_nvfp4_blocks(x_Bx16, scale, s_dec)
    deq = numerics.decode_nvfp4_blocks(values, scale, s_dec)
    err = jnp.sum(jnp.square(deq - x_Bx16), axis=-1)
    peak = jnp.max(jnp.abs(deq), axis=-1)
    if block == "2d":
        r, nb = err.shape
        tile = err.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, nb).sum(axis=1, keepdims=True)
        err = jnp.broadcast_to(tile, (r // NVFP4_BLOCK, NVFP4_BLOCK, nb)).reshape(r, nb)
    return codes, err, peak
