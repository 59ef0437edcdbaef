"""Shared block machinery: tensor and tile amax, tile expansion, subnormal flushing, input checks.

Division: use `exact_divide`, never `/` with a scalar or repeated divisor (see its docstring).

Subnormal policy: XLA:CPU runs with flush-to-zero / denormals-are-zero, XLA:GPU keeps fp32
subnormals. To give the same bytes on every backend the quantizers flush explicitly, at the
input and at every intermediate that can become subnormal (see `flush_subnormal`); the test
oracle models the same rule. Real tensors never hold values below 2**-126, so this only pins
down otherwise backend-dependent corner cases.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics.constants import FLT_MIN_NORMAL


def flush_subnormal(x: jax.Array) -> jax.Array:
    """Replace fp32 subnormals by zero of the same sign (what XLA:CPU does implicitly)."""
    # copysign keeps -0 for negative subnormals, as hardware flush-to-zero does.
    return jnp.where(jnp.abs(x) < FLT_MIN_NORMAL, jnp.copysign(jnp.zeros_like(x), x), x)


def times_decode_scale(x: jax.Array, s_dec: jax.Array) -> jax.Array:
    """flush(fp32(x) * s_dec): a stored decode's last step (NVFP4's after the block scale, FP8's)."""
    return flush_subnormal(x.astype(jnp.float32) * s_dec)


def exact_divide(numerator: jax.Array, divisor: jax.Array) -> jax.Array:
    """IEEE fp32 `numerator / divisor`, correctly rounded even when `divisor` is broadcast.

    XLA's algebraic simplifier rewrites `a / broadcast(b)` (a scalar, a constant or a repeated
    array) into `a * broadcast(1 / b)`, which differs from the division in ~25% of cases. The
    optimization barrier hides the broadcast so the division stays a division.
    """
    shape = jnp.broadcast_shapes(jnp.shape(numerator), jnp.shape(divisor))
    divisor = xla_barrier(jnp.broadcast_to(divisor, shape))
    return numerator / divisor


def xla_barrier(x):
    """`lax.optimization_barrier(x)`: a guard against XLA's rewrites (`exact_divide`) and fusion
    choices; the identity while tracing under `without_xla_barriers`."""
    return jax.lax.optimization_barrier(x) if _XLA_BARRIERS.get() else x


@contextlib.contextmanager
def without_xla_barriers() -> Iterator[None]:
    """Trace without `xla_barrier`s: for a kernel compiled by a compiler that has neither XLA's
    algebraic simplifier nor its fusion (Pallas' Triton lowering, which has no barrier either)."""
    token = _XLA_BARRIERS.set(False)
    try:
        yield
    finally:
        _XLA_BARRIERS.reset(token)


_XLA_BARRIERS = contextvars.ContextVar("xla_barriers", default=True)


def check_finite(x: jax.Array | np.ndarray, name: str = "tensor") -> None:
    """Raise NVFP4ToolError if concrete `x` holds inf or NaN; no-op for traced values.

    Inside `jax.jit` values are unknown, so traced callers must check before tracing (call this on
    the concrete input) or test `jnp.isfinite(x).all()` themselves and act on the result.
    """
    if isinstance(x, jax.core.Tracer):
        return
    with jax.ensure_compile_time_eval():  # a concrete array closed over inside a jit trace
        finite = bool(jnp.isfinite(jnp.asarray(x)).all())
    if not finite:
        raise NVFP4ToolError(
            f"tensor '{name}' (shape {tuple(np.shape(x))}) holds inf or NaN; non-finite values cannot be quantized"
        )


def check_scale_scalar(value, what: str, name: str, *, positive: bool = False) -> jax.Array:
    """`value` as an fp32 scalar, or NVFP4ToolError naming the tensor unless it is one finite
    value >= 0 (> 0 when `positive`). Traced values get only the shape check."""
    value = jnp.asarray(value, jnp.float32)
    if value.ndim != 0:
        raise NVFP4ToolError(f"tensor '{name}': {what} must be a scalar, got shape {tuple(value.shape)}")
    if isinstance(value, jax.core.Tracer):
        return value
    number = float(value)
    if not np.isfinite(number) or number < 0 or (positive and number == 0):
        raise NVFP4ToolError(
            f"tensor '{name}': {what} must be finite and {'> 0' if positive else '>= 0'}, got {number}"
        )
    return value


def normalize_axis(axis: int, ndim: int, name: str) -> int:
    """`axis` as a non-negative index, or NVFP4ToolError naming the tensor."""
    if not -ndim <= axis < ndim:
        raise NVFP4ToolError(f"tensor '{name}': axis {axis} out of range for {ndim}-D input")
    return axis % ndim


def tensor_amax(x: jax.Array) -> jax.Array:
    """max|x| as an fp32 scalar: a tensor's (or, maxed over members, a fused group's) global amax,
    and the input amax that static activation scales come from. Exact in any float dtype."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def tile_amax(abs_x: jax.Array, tile_rows: int, tile_cols: int) -> jax.Array:
    """Max over tiles of `tile_rows` x `tile_cols` of the last two axes of `abs_x` (>= 0 values).

    `tile_rows == 1` reduces along the last axis only (any ndim >= 1). Ragged edge tiles use the
    elements that exist (the array is padded with zeros, which cannot raise a max of |x|).
    Returns shape `[..., ceil(N/tile_rows), ceil(K/tile_cols)]` (no row axis when tile_rows == 1).
    """
    cols = abs_x.shape[-1]
    n_col_tiles = -(-cols // tile_cols)
    if tile_rows == 1:
        padded = _pad_axis(abs_x, -1, n_col_tiles * tile_cols)
        return padded.reshape(*abs_x.shape[:-1], n_col_tiles, tile_cols).max(axis=-1)
    rows = abs_x.shape[-2]
    n_row_tiles = -(-rows // tile_rows)
    padded = _pad_axis(_pad_axis(abs_x, -1, n_col_tiles * tile_cols), -2, n_row_tiles * tile_rows)
    tiled = padded.reshape(*abs_x.shape[:-2], n_row_tiles, tile_rows, n_col_tiles, tile_cols)
    return tiled.max(axis=(-3, -1))


def expand_tiles(per_tile: jax.Array, tile_rows: int, tile_cols: int, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of `tile_amax`'s layout: repeat each tile value over its tile, cut to `shape`."""
    out = jnp.repeat(per_tile, tile_cols, axis=-1)[..., : shape[-1]]
    if tile_rows != 1:
        out = jnp.repeat(out, tile_rows, axis=-2)[..., : shape[-2], :]
    return out


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `x` at the end of `axis` up to `size`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)
