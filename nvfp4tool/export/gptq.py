"""GPTQ for NVFP4 weights: error-compensating rounding with fixed or updated block scales (Frantar et al. 2022).

    q, err = gptq_quantize(w_NxK, h_KxK, method="rtn", block="1d", global_amax=group_amax, damp=0.05,
                           block_scales="original")

Scales come from the ORIGINAL weight as in the RTN export; columns are rounded one after another,
each one's error spread over the later ones through H = X^T X. `err` is a `GPTQError`.
Design notes: docs/design/gptq.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool import numerics, progress
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export.scale_search import quantize_weight, slice_scales
from nvfp4tool.numerics import NVFP4Array
from nvfp4tool.numerics.blocks import flush_subnormal
from nvfp4tool.numerics.constants import NVFP4_BLOCK

BLOCK_COLUMNS = 128  # columns per lazy-batch block
DEFAULT_DAMP = 0.05
# --gptq-damp: 0 < damp <= 1 (GPTQ's percdamp, a fraction of mean(diag H); implementations use
# 0.01-0.1). As damp grows, H tends to c * I, which spreads no rounding error (GPTQ tends to RTN), and
# an inf or huge one overflows H: beyond 1 it is a mistake, not a setting.
DAMP_RANGE = (0.0, 1.0)
# --gptq-block-scales: "original" fixes every block scale on the original weight (as RTN's);
# "updated" chooses each 16-column block's scales as GPTQ reaches it, from the weights as its
# earlier columns' errors have updated them (the reference GPTQ's groups, static_groups=False)
BLOCK_SCALES = ("original", "updated")


@dataclasses.dataclass(frozen=True)
class GPTQError:
    """Errors of one GPTQ-quantized linear."""

    rel_l2: float  # weight error ||decode(q) - w|| / ||w||
    output_rel_err: float  # sqrt(tr(D H D^T) / tr(W H W^T)), D = w - decode(q)
    rtn_output_rel_err: float  # the same for nearest rounding with the same scales
    decoded_amax: float  # max |decode(q)|


def block_order(diag_K: np.ndarray) -> np.ndarray:
    """Column permutation [K] of the static activation order: 16-column blocks by descending sum
    of diag(H) (`diag_K`, dead columns' set to 1) over the block, stable on ties, each block's
    columns in order."""
    sums = np.asarray(diag_K, np.float64).reshape(-1, NVFP4_BLOCK).sum(axis=1)
    blocks = np.argsort(-sums, kind="stable")
    return (blocks[:, None] * NVFP4_BLOCK + np.arange(NVFP4_BLOCK)).reshape(-1)


def gptq_quantize(
    w_NxK: np.ndarray | jax.Array,
    h_KxK: np.ndarray | jax.Array,
    *,
    method: str = "rtn",
    block: str = "1d",
    global_amax: float,
    damp: float = DEFAULT_DAMP,
    act_order: bool = True,
    block_size: int = BLOCK_COLUMNS,
    mse_radius: int = 2,
    name: str = "weight",
    block_scales: str = "original",
) -> tuple[NVFP4Array, GPTQError]:
    """NVFP4 of `w_NxK` by GPTQ with Hessian `h_KxK` (undamped X^T X), scales by `method` (see the
    module docstring). Returns the record (numpy arrays) and its errors."""
    if block_scales not in BLOCK_SCALES:
        raise NVFP4ToolError(f"unknown GPTQ block scales {block_scales!r}; choose one of {', '.join(BLOCK_SCALES)}")
    rtn, _ = quantize_weight(
        w_NxK, method=method, block=block, global_amax=global_amax, mse_radius=mse_radius, name=name
    )
    n, k = rtn.shape
    h = np.asarray(h_KxK, np.float32)
    if h.shape != (k, k):
        raise NVFP4ToolError(f"tensor '{name}': Hessian {h.shape} does not match in_features {k}")
    if not np.isfinite(h).all():
        raise NVFP4ToolError(f"tensor '{name}': the calibration Hessian has non-finite values")
    diag = np.diagonal(h).copy()
    diag[diag == 0] = 1  # dead columns, as the damping sees them
    perm = block_order(diag) if act_order else np.arange(k)
    refresh = None if block_scales == "original" else (method, block, mse_radius)
    with progress.compiling(
        f"GPTQ rounding of {n}x{k} weights", key=(_gptq_codes, n, k, str(w_NxK.dtype), block_size, refresh)
    ):
        codes, scales, finite = _gptq_codes(
            jnp.asarray(w_NxK),
            jnp.asarray(h),
            jnp.asarray(rtn.scales),
            jnp.float32(global_amax),
            jnp.float32(rtn.global_amax),
            jnp.asarray(perm, jnp.int32),
            jnp.float32(damp),
            block_size=block_size,
            refresh=refresh,
        )
    if not bool(finite):
        raise NVFP4ToolError(f"tensor '{name}': the damped Hessian is not positive definite; raise --gptq-damp")
    record = dataclasses.replace(rtn, packed=np.asarray(numerics.pack_codes(codes)), scales=np.asarray(scales))
    errors = _errors(jnp.asarray(w_NxK), jnp.asarray(h), record, rtn)
    return record, GPTQError(*(float(e) for e in np.asarray(errors)))


# ------------------------------------------------------------------------------------------
# helpers


@functools.partial(jax.jit, static_argnames=("block_size", "refresh"))
def _gptq_codes(w_NxK, h_KxK, scales_NxKb, gamax, record_amax, perm_K, damp, *, block_size, refresh):
    """(uint8 codes [N, K] and E4M3 block scales [N, K/16] in the original column order, whether the
    Cholesky was finite). `refresh`: None (the scales stay `scales_NxKb`) or (method, block,
    mse_radius) of `scale_search.slice_scales`, which then chooses the scales of each 16-column
    slice of the updated weights as it is reached (`gamax`: the group amax, `record_amax`: the
    record's global amax)."""
    _, s_dec = numerics.nvfp4_global_scales(record_amax)
    n, k = w_NxK.shape
    w = flush_subnormal(w_NxK.astype(jnp.float32))
    dead = jnp.diagonal(h_KxK) == 0
    h = h_KxK + jnp.diag(dead.astype(jnp.float32))
    w = jnp.where(dead[None, :], jnp.float32(0), w)
    h = h + jnp.eye(k, dtype=jnp.float32) * (damp * jnp.mean(jnp.diagonal(h)))
    # permute: columns of w, rows and columns of h, the per-column block scale
    w = w[:, perm_K]
    h = h[perm_K][:, perm_K]
    scales_NxK = jnp.repeat(scales_NxKb, NVFP4_BLOCK, axis=1)[:, perm_K]
    # pad K to whole blocks: zero weights, identity Hessian (nothing flows into or out of them)
    kp = -(-k // block_size) * block_size
    w = jnp.pad(w, ((0, 0), (0, kp - k)))
    h = jnp.pad(h, ((0, kp - k), (0, kp - k))) + jnp.diag((jnp.arange(kp) >= k).astype(jnp.float32))
    scales_NxK = jnp.pad(scales_NxK.astype(jnp.float32), ((0, 0), (0, kp - k)), constant_values=1.0).astype(
        jnp.float8_e4m3fn
    )
    lower = jnp.linalg.cholesky(h)
    h_inv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(kp, dtype=jnp.float32))
    u = jnp.linalg.cholesky(h_inv).T  # upper: H^-1 = U^T U
    ok = jnp.all(jnp.isfinite(u))

    def one_block(b, carry):
        w, codes, scales_NxK = carry
        i = b * block_size
        w_blk = jax.lax.dynamic_slice_in_dim(w, i, block_size, axis=1)
        u_blk = jax.lax.dynamic_slice(u, (i, i), (block_size, block_size))
        s_blk = jax.lax.dynamic_slice_in_dim(scales_NxK, i, block_size, axis=1)

        def one_column(j, carry):
            w_blk, q_blk, e_blk, s_blk = carry
            if refresh is not None:  # entering a 16-column block: its scales from the updated weights

                def renew(s_blk):
                    part = flush_subnormal(jax.lax.dynamic_slice_in_dim(w_blk, j, NVFP4_BLOCK, axis=1))
                    method, block, radius = refresh
                    fresh = jnp.repeat(
                        slice_scales(part, gamax, record_amax, method=method, block=block, mse_radius=radius),
                        NVFP4_BLOCK,
                        axis=1,
                    )
                    return jax.lax.dynamic_update_slice_in_dim(s_blk, fresh, j, axis=1)

                s_blk = jax.lax.cond(j % NVFP4_BLOCK == 0, renew, lambda s: s, s_blk)
            w_j = flush_subnormal(jax.lax.dynamic_slice_in_dim(w_blk, j, 1, axis=1))  # [N, 1]
            s_j = jax.lax.dynamic_slice_in_dim(s_blk, j, 1, axis=1)[:, 0]  # [N]: one "block" per row
            q_j, v_j = numerics.encode_nvfp4_blocks(w_j, s_j, s_dec)
            e_j = (w_j - numerics.decode_nvfp4_blocks(v_j, s_j, s_dec)) / u_blk[j, j]
            u_row = jnp.where(jnp.arange(block_size) > j, u_blk[j], jnp.float32(0))
            w_blk = w_blk - e_j * u_row[None, :]
            return (
                w_blk,
                jax.lax.dynamic_update_slice_in_dim(q_blk, q_j, j, axis=1),
                jax.lax.dynamic_update_slice_in_dim(e_blk, e_j, j, axis=1),
                s_blk,
            )

        zeros = jnp.zeros((n, block_size), jnp.float32)
        _, q_blk, e_blk, s_blk = jax.lax.fori_loop(
            0, block_size, one_column, (w_blk, zeros.astype(jnp.uint8), zeros, s_blk)
        )
        scales_NxK = jax.lax.dynamic_update_slice_in_dim(scales_NxK, s_blk, i, axis=1)
        u_rows = jax.lax.dynamic_slice_in_dim(u, i, block_size, axis=0)
        later = jnp.where(jnp.arange(kp)[None, :] >= i + block_size, u_rows, jnp.float32(0))
        w = w - jnp.matmul(e_blk, later, precision=jax.lax.Precision.HIGHEST)
        return w, jax.lax.dynamic_update_slice_in_dim(codes, q_blk, i, axis=1), scales_NxK

    _, codes, scales_NxK = jax.lax.fori_loop(
        0, kp // block_size, one_block, (w, jnp.zeros((n, kp), jnp.uint8), scales_NxK)
    )
    unperm = jnp.argsort(perm_K)
    return codes[:, :k][:, unperm], scales_NxK[:, :k][:, unperm][:, ::NVFP4_BLOCK], ok


@jax.jit
def _errors(w_NxK, h_KxK, q: NVFP4Array, rtn: NVFP4Array):
    """[weight rel L2, output rel error, RTN output rel error, max |decode(q)|]."""
    w = flush_subnormal(w_NxK.astype(jnp.float32))
    deq, deq_rtn = numerics.dequantize_nvfp4(q), numerics.dequantize_nvfp4(rtn)

    def quad(d):  # tr(D H D^T)
        return jnp.sum(jnp.matmul(d, h_KxK, precision=jax.lax.Precision.HIGHEST) * d)

    def rel(err, norm):
        return jnp.where(norm > 0, jnp.sqrt(err / jnp.where(norm > 0, norm, 1)), 0.0)

    norm = quad(w)
    return jnp.stack(
        [
            rel(jnp.sum(jnp.square(deq - w)), jnp.sum(jnp.square(w))),
            rel(quad(w - deq), norm),
            rel(quad(w - deq_rtn), norm),
            jnp.max(jnp.abs(deq)),
        ]
    )
