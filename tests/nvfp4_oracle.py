"""Independent, slow NVFP4 oracle in plain Python/numpy, written from the reference sheet.

It does not import nvfp4tool. Every fp32 operation is a numpy float32 scalar operation (IEEE,
round to nearest even) followed by flush-to-zero of subnormals, which is the rule the package
follows on every backend (XLA:CPU flushes implicitly). E2M1 and E4M3 rounding are done here
from value tables decoded from the bit patterns, by comparing distances to both neighbours; no
library cast does the rounding. Tensors are small: loops are per element.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
FLT_MIN = F32(2.0**-126)


# ---------------------------------------------------------------- formats from their bits


def e2m1_value(code: int) -> float:
    """Value of a 4-bit E2M1 code: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 1
    if exponent == 0:
        return sign * mantissa * 0.5  # subnormal: m * 2^(1-1) * 1/2
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def e4m3_value(byte: int) -> float:
    """Value of a float8_e4m3fn byte: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan  # the only NaN encodings (no inf)
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


_E4M3_NONNEG = [(e4m3_value(b), b) for b in range(0x7F)]  # bytes 0..126: 0 .. 448, increasing
_E2M1_NONNEG = [(e2m1_value(c), c) for c in range(8)]  # codes 0..7: 0 .. 6, increasing


def _round_to_table(value: float, table: list[tuple[float, int]]) -> int:
    """Nearest table entry to value (>= 0, <= last entry); a tie goes to the even code."""
    for (lo, lo_code), (hi, hi_code) in zip(table, table[1:]):
        if lo <= value <= hi:
            below, above = value - lo, hi - value  # exact in float64 for these magnitudes
            if below < above:
                return lo_code
            if above < below:
                return hi_code
            return lo_code if lo_code % 2 == 0 else hi_code
    raise ValueError(f"{value} outside the table")


def e4m3_rne(value: F32) -> int:
    """Byte of float8_e4m3fn nearest to value in [0, 448], ties to even mantissa."""
    return _round_to_table(float(value), _E4M3_NONNEG)


def e2m1_rne(magnitude: F32) -> int:
    """Code 0..7 nearest to magnitude in [0, 6], ties to even code."""
    return _round_to_table(float(magnitude), _E2M1_NONNEG)


def e2m1_neighbours(magnitude: float) -> tuple[float, float]:
    """The two E2M1 magnitudes around `magnitude` in [0, 6] (equal when it is one of them)."""
    values = [v for v, _ in _E2M1_NONNEG]
    lo = max(v for v in values if v <= magnitude)
    hi = min(v for v in values if v >= magnitude)
    return lo, hi


# ---------------------------------------------------------------- fp32 with flush-to-zero


def ftz(v) -> F32:
    v = F32(v)
    return F32(math.copysign(0.0, v)) if abs(v) < FLT_MIN else v


def mul(a, b) -> F32:
    with np.errstate(over="ignore", under="ignore"):
        return ftz(F32(ftz(a)) * F32(ftz(b)))


def div(a, b) -> F32:
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        return ftz(F32(ftz(a)) / F32(ftz(b)))


# ---------------------------------------------------------------- NVFP4


def global_scales(gamax) -> tuple[F32, F32]:
    gamax = ftz(gamax)
    s_enc = div(2688.0, gamax)
    s_enc = min(s_enc, FLT_MAX)
    if gamax == 0 or s_enc == 0:
        s_enc = F32(1.0)
    return F32(s_enc), div(1.0, s_enc)


def quantize(x: np.ndarray, *, block: str = "1d", global_amax=None) -> dict:
    """NVFP4 along the last axis. 2d: tiles of 16 rows (second-to-last axis) x 16 columns.

    Returns packed (uint8 [..., K/2]), scales (uint8 bytes of E4M3 [..., K/16]), global_amax
    (float32), plus per-element `enc` (float32) for tests that need the encode factor.
    """
    x32 = np.asarray(x).astype(np.float32)
    if block == "1d":
        x32 = x32.reshape(1, -1, x32.shape[-1]) if x32.ndim >= 2 else x32.reshape(1, 1, -1)
    rows, cols = x32.shape[-2:]
    x32 = x32.reshape(-1, rows, cols)
    flat = [ftz(v) for v in x32.ravel()]
    x32 = np.array(flat, np.float32).reshape(x32.shape)

    gamax = max((abs(v) for v in flat), default=F32(0)) if global_amax is None else global_amax
    gamax = ftz(gamax)
    s_enc, s_dec = global_scales(gamax)
    tile_rows = 16 if block == "2d" else 1

    codes = np.zeros(x32.shape, np.uint8)
    scales = np.zeros((*x32.shape[:-1], cols // 16), np.uint8)
    enc_all = np.zeros(x32.shape, np.float32)
    for b in range(x32.shape[0]):
        for r0 in range(0, rows, tile_rows):
            for c0 in range(0, cols, 16):
                tile = x32[b, r0 : r0 + tile_rows, c0 : c0 + 16]
                bamax = max(abs(F32(v)) for v in tile.ravel())
                sdb = mul(bamax, mul(s_enc, F32(1.0 / 6.0)))
                sdb = min(sdb, FLT_MAX)
                sdb = min(max(sdb, F32(0.0)), F32(448.0))
                byte = e4m3_rne(sdb)
                denom = mul(F32(e4m3_value(byte)), s_dec)
                enc = min(div(1.0, denom), FLT_MAX)
                for r in range(r0, min(r0 + tile_rows, rows)):
                    scales[b, r, c0 // 16] = byte
                    for c in range(c0, c0 + 16):
                        xv = x32[b, r, c]
                        y = mul(xv, enc)
                        magnitude = min(abs(y), F32(6.0))
                        code = e2m1_rne(magnitude)
                        if np.signbit(xv):
                            code |= 0b1000
                        codes[b, r, c] = code
                        enc_all[b, r, c] = enc
    out_shape = np.shape(x)
    codes = codes.reshape(out_shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return {
        "packed": packed,
        "scales": scales.reshape(*out_shape[:-1], cols // 16),
        "global_amax": F32(gamax),
        "enc": enc_all.reshape(out_shape),
        "s_dec": s_dec,
    }


def dequantize(packed: np.ndarray, scales: np.ndarray, global_amax) -> np.ndarray:
    """fp32 decode with the S_dec of `global_amax`."""
    return decode(packed, scales, global_scales(global_amax)[1])


def decode(packed: np.ndarray, scales: np.ndarray, s_dec) -> np.ndarray:
    """fp32 decode of stored bytes: (e2m1(code) * e4m3(scale)) * S_dec, elementwise with FTZ."""
    s_dec = F32(s_dec)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    out = np.zeros(codes.shape, np.float32)
    for idx in np.ndindex(codes.shape):
        scale = F32(e4m3_value(int(scales[idx[:-1] + (idx[-1] // 16,)])))
        out[idx] = mul(mul(F32(e2m1_value(int(codes[idx]))), scale), s_dec)
    return out


# ---------------------------------------------------------------- FP8 (tiny oracle)


def quantize_fp8(
    x: np.ndarray, fmt: str, tile_rows: int | None, tile_cols: int | None, static_scale: float | None = None
):
    """FP8 current scaling over tiles (None = whole axis); ml_dtypes does the final cast.

    scale = amax / fmt_max (1 where that is 0), or `static_scale` everywhere when given;
    data = cast(clip(x / scale, -max, max)).
    Returns (data as float fp8 values in float32, per-element scale in float32).
    """
    import ml_dtypes

    fp8_dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    fmt_max = F32({"e4m3": 448.0, "e5m2": 57344.0}[fmt])
    x32 = np.vectorize(ftz, otypes=[np.float32])(np.asarray(x).astype(np.float32))
    x2 = x32.reshape(-1, x32.shape[-1]) if x32.ndim >= 2 else x32.reshape(1, -1)
    rows, cols = x2.shape
    tr = rows if tile_rows is None else tile_rows
    tc = cols if tile_cols is None else tile_cols
    scale = np.zeros_like(x2)
    for r0 in range(0, rows, tr):
        for c0 in range(0, cols, tc):
            amax = F32(np.abs(x2[r0 : r0 + tr, c0 : c0 + tc]).max())
            s = div(amax, fmt_max) if static_scale is None else F32(static_scale)
            scale[r0 : r0 + tr, c0 : c0 + tc] = F32(1.0) if s == 0 else s
    scaled = np.array([div(a, s) for a, s in zip(x2.ravel(), scale.ravel())], np.float32)
    data = np.clip(scaled, -fmt_max, fmt_max).astype(fp8_dtype).astype(np.float32)
    return data.reshape(x32.shape), scale.reshape(x32.shape)


# ---------------------------------------------------------------- GEMM reference


def gemm_with_bound(a: np.ndarray, b: np.ndarray, roundings: int) -> tuple[np.ndarray, np.ndarray]:
    """(a @ b.T in float64, a bound on the error of an fp32 evaluation of it) for a [..., M, K],
    b [N, K]. The bound holds for any evaluation in which each term a_k * b_k passes through at
    most `roundings` fp32 roundings (operand rounding, product, summation in any order, scaling):
    gamma_n * sum_k |a_k| |b_k| with gamma_n = n u / (1 - n u), u = 2**-24 (Higham, Accuracy and
    Stability of Numerical Algorithms, section 3.1). Subnormals are not modelled.
    """
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nu = roundings * 2.0**-24
    return a64 @ b64.T, nu / (1 - nu) * (np.abs(a64) @ np.abs(b64).T)
