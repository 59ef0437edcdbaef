"""Numeric constants of the NVFP4 and FP8 formats, each annotated with its value."""

from __future__ import annotations

import numpy as np

# --- E2M1 (FP4) elements -------------------------------------------------------------------
E2M1_MAX = 6.0  # largest float4_e2m1fn magnitude
# Magnitudes of codes 0..7 (codes 8..15 are the same values negated; code 8 is -0).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even decision points on |y| between consecutive magnitudes. At a midpoint the
# neighbour with an even code wins: "<=" thresholds round a tie down, "<" thresholds round it up.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)  # 0|0.5, 0.5|1, 1|1.5, ...
E2M1_SIGN_BIT = 0x8  # bit 3 of a code; code 8 is -0

# --- E4M3 (block scale, FP8 data) ----------------------------------------------------------
E4M3_MAX = 448.0  # float8_e4m3fn max
E4M3_MAX_CODE = 0x7E  # bit pattern of 448, the largest finite float8_e4m3fn (0x7F is NaN)
E5M2_MAX = 57344.0  # float8_e5m2 max
FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}

# --- NVFP4 two-level scaling ---------------------------------------------------------------
NVFP4_BLOCK = 16  # elements per block scale along K
NVFP4_GLOBAL_RANGE = E2M1_MAX * E4M3_MAX  # 2688.0 = 6 * 448, S_enc = 2688 / amax

# --- FP32 limits -----------------------------------------------------------------------------
FLT_MAX = float(np.finfo(np.float32).max)  # 3.4028235e38
FLT_MIN_NORMAL = float(np.finfo(np.float32).tiny)  # 1.1754944e-38 = 2**-126

# --- Random Hadamard transform -------------------------------------------------------------
RHT_SIZE = 16  # chunk length of the transform
# TE's fixed sign vector s in H = diag(s) @ H16 / 4.
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

# --- FP8 block baselines -------------------------------------------------------------------
FP8_BLOCK = 128  # block128 (1x128) and block128x128 tiles
