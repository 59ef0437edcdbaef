"""The NVFP4 training GEMMs of one linear layer, as a `jax.custom_vjp` (sheet section 3).

    fprop  Y  = X W^T    X: 1x16 along K, RNE          W: 16x16 2D, RNE
    dgrad  dX = dY W     dY: 1x16 along N, SR          W: the same 2D-quantized values (along N)
    wgrad  dW = dY^T X   dY^T: RHT, 1x16 along T, SR   X^T: RHT, 1x16 along T, RNE

`NVFP4Options.quantizer` (xla | pallas) and `.gemm` (emulated | native); `resolve_backend` picks "auto".
Design notes: docs/design/precision.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import (
    NVFP4Array,
    NVFP4Operand,
    dot_nt,
    fake_quantize_nvfp4,
    native_fp4_available,
    nvfp4_matmul,
    nvfp4_operand,
    nvfp4_operand_matmul,
    quantize_nvfp4,
    rht16,
    stochastic_bits,
    tensor_amax,
    transpose_2d,
)
from nvfp4tool.numerics.fused import fused_quantize

Quantizer = Literal["auto", "xla", "pallas"]
QUANTIZERS = ("auto", "xla", "pallas")
Gemm = Literal["auto", "emulated", "native"]
GEMMS = ("auto", "emulated", "native")
PackedMatmul = Callable[[NVFP4Array, NVFP4Array], jax.Array]
NATIVE_MATMUL: PackedMatmul = functools.partial(nvfp4_matmul, backend="native")


def resolve_backend(quantizer: str, gemm: str) -> tuple[str, str]:
    """(quantizer, gemm) with each "auto" replaced by this platform's choice: quantizer "pallas"
    on a GPU, else "xla"; gemm "native" where the FP4 GEMM is native, else "emulated"."""
    if quantizer == "auto":
        quantizer = "pallas" if jax.default_backend() == "gpu" else "xla"
    if gemm == "auto":
        gemm = "native" if native_fp4_available() else "emulated"
    return quantizer, gemm


@dataclasses.dataclass(frozen=True)
class NVFP4Options:
    """Switches of the recipe (all on = NVIDIA's recipe; off = an ablation), who quantizes, and
    which GEMM multiplies."""

    rht: bool = True  # random Hadamard transform on both wgrad operands (along tokens)
    stochastic_rounding: bool = True  # SR on the gradient dY (dgrad and wgrad)
    weight_2d: bool = True  # 16x16 weight scales (else 1x16 along K in fprop, along N in dgrad)
    quantize_fprop: bool = True  # False: fprop in the input dtype (the late switch to BF16)
    quantizer: Quantizer = "auto"  # "xla" | "pallas" (fused kernels) | "auto": pallas on a GPU
    gemm: Gemm = "auto"  # "emulated" | "native" (packed operands) | "auto": native where it is
    packed_matmul: PackedMatmul = NATIVE_MATMUL  # gemm "native"'s `a @ b.T` of two NVFP4Arrays

    def __post_init__(self) -> None:
        if self.quantizer not in QUANTIZERS:
            raise NVFP4ToolError(f"quantizer must be one of {', '.join(QUANTIZERS)}, got {self.quantizer!r}")
        if self.gemm not in GEMMS:
            raise NVFP4ToolError(f"gemm must be one of {', '.join(GEMMS)}, got {self.gemm!r}")


@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    """A weight's GEMM operands, quantized once (`quantize_weight`; a pytree): `fprop`, W [N, K]
    along K (None when fprop runs unquantized and scaling is 1x16), and `dgrad`, W^T [K, N] along
    N (None with 16x16 scaling: it is `transpose_2d(fprop)`). Each an NVFP4Operand (gemm
    emulated) or an NVFP4Array (native)."""

    fprop: NVFP4Operand | NVFP4Array | None
    dgrad: NVFP4Operand | NVFP4Array | None


jax.tree_util.register_dataclass(NVFP4Weight, data_fields=["fprop", "dgrad"], meta_fields=[])


WEIGHT_QUANTIZED = "nvfp4_weight_quantized"  # the checkpoint name tagging each quantize_weight result


def quantize_weight(
    w_NxK: jax.Array, w_global_amax: jax.Array | None = None, options: NVFP4Options = NVFP4Options()
) -> NVFP4Weight:
    """The operands `nvfp4_dot` multiplies `w_NxK` with (see `NVFP4Weight`); `w_global_amax` as
    in `nvfp4_dot`. No gradient flows through them (nvfp4_dot's gradient reaches w directly).
    Each call tags one of its outputs `checkpoint_name(..., WEIGHT_QUANTIZED)` (an identity: one
    `name` equation per call in a jaxpr, which the tests count; no remat policy saves it)."""
    w_NxK = jax.lax.stop_gradient(w_NxK)
    amax = jax.lax.stop_gradient(
        jnp.asarray(tensor_amax(w_NxK) if w_global_amax is None else w_global_amax, jnp.float32)
    )
    gemm = _Gemms.of(options)
    if options.weight_2d:
        fprop, dgrad = gemm.operand(w_NxK, block="2d", global_amax=amax), None
    else:
        fprop = gemm.operand(w_NxK, global_amax=amax) if options.quantize_fprop else None
        dgrad = gemm.operand(w_NxK, transpose=True, global_amax=amax)
    leaves, tree = jax.tree.flatten(NVFP4Weight(fprop=fprop, dgrad=dgrad))
    return jax.tree.unflatten(tree, [checkpoint_name(leaves[0], WEIGHT_QUANTIZED), *leaves[1:]])


def nvfp4_dot(
    x_TxK: jax.Array,
    w_NxK: jax.Array,
    key: jax.Array,
    w_global_amax: jax.Array | None = None,
    options: NVFP4Options = NVFP4Options(),
    weight: NVFP4Weight | None = None,
) -> jax.Array:
    """`x @ w.T` in fp32 (x: [..., K], w: [N, K]) with the NVFP4 recipe's forward and backward.

    `key` seeds the stochastic rounding of this layer's gradient; `w_global_amax` is the shared
    amax of the weight's fused group (q/k/v, gate/up), or None for the weight's own amax.
    `weight`: w's operands from `quantize_weight(w, w_global_amax, options)` (quantized ahead,
    e.g. once per optimizer step), or None to quantize them here.
    K, N and the token count must be multiples of 16.
    """
    if w_global_amax is None:
        w_global_amax = tensor_amax(w_NxK)
    lead_shape = x_TxK.shape[:-1]
    y_TxN = _nvfp4_dot(
        x_TxK.reshape(-1, x_TxK.shape[-1]),
        w_NxK,
        key,
        jax.lax.stop_gradient(jnp.asarray(w_global_amax, jnp.float32)),
        weight,
        options,
    )
    return y_TxN.reshape(*lead_shape, w_NxK.shape[0])


def weight_only_dot(
    x_TxK: jax.Array, w_NxK: jax.Array, w_global_amax: jax.Array | None, block: str, *, quantize_fprop: bool = True
) -> jax.Array:
    """`x @ fq(w).T` in fp32 for a W4A16 (NVFP4 weight-only) linear's training: fq the NVFP4
    fake quantization of w (RNE, `block` 1d / 2d scales against `w_global_amax`, None: its own),
    as its export quantizes it; x and the gradients stay in x's dtype. Backward: dX = dY fq(w), dW
    = dY^T X (straight through fq, as QAT of weight-only formats does). `quantize_fprop` False:
    `x @ w.T` (the late switch to BF16)."""
    if not quantize_fprop:
        return dot_nt(x_TxK, w_NxK)
    amax = jax.lax.stop_gradient(
        jnp.asarray(tensor_amax(w_NxK) if w_global_amax is None else w_global_amax, jnp.float32)
    )
    return _weight_only_dot(x_TxK, w_NxK, amax, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _weight_only_dot(x_TxK, w_NxK, amax, block):
    return dot_nt(x_TxK, _fake_weight(w_NxK, amax, block))


def _fake_weight(w_NxK, amax, block):
    return fake_quantize_nvfp4(jax.lax.stop_gradient(w_NxK), block=block, global_amax=amax, name="weight")


def _weight_only_fwd(x_TxK, w_NxK, amax, block):
    w_q = _fake_weight(w_NxK, amax, block)
    return dot_nt(x_TxK, w_q), (x_TxK, w_q, amax)


def _weight_only_bwd(block, residuals, dy_TxN):
    x_TxK, w_q, amax = residuals
    dy = dy_TxN.astype(x_TxK.dtype)
    dx_TxK = dot_nt(dy, w_q.T)
    dw_NxK = dot_nt(dy.reshape(-1, dy.shape[-1]).T, x_TxK.reshape(-1, x_TxK.shape[-1]).T)
    return dx_TxK.astype(x_TxK.dtype), dw_NxK.astype(w_q.dtype), jnp.zeros_like(amax)


_weight_only_dot.defvjp(_weight_only_fwd, _weight_only_bwd)


# ------------------------------------------------------------------------------------------
# the custom VJP: one block, forward then backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _nvfp4_dot(x_TxK, w_NxK, key, w_amax, weight, options):
    return _fprop(x_TxK, w_NxK, w_amax, weight, options)


def _fprop(x_TxK, w_NxK, w_amax, weight, options):
    if not options.quantize_fprop:
        return dot_nt(x_TxK, w_NxK)
    if weight is None:
        weight = quantize_weight(w_NxK, w_amax, options)
    gemm = _Gemms.of(options)
    return gemm.matmul(gemm.operand(x_TxK), weight.fprop)


def _nvfp4_dot_fwd(x_TxK, w_NxK, key, w_amax, weight, options):
    if weight is None:  # quantized once, for fprop and kept for dgrad
        weight = quantize_weight(w_NxK, w_amax, options)
    return _fprop(x_TxK, w_NxK, w_amax, weight, options), (x_TxK, w_NxK, key, weight)


def _nvfp4_dot_bwd(options, residuals, dy_TxN):
    x_TxK, w_NxK, key, weight = residuals
    dgrad_key, wgrad_key = jax.random.split(key)
    if not options.stochastic_rounding:
        dgrad_key = wgrad_key = None
    dy_TxN = dy_TxN.astype(jnp.float32)
    gemm = _Gemms.of(options)

    # dgrad: dX = dY W, contracting over N: both operands quantized along N (16x16 scaling: W's
    # is fprop's, transposed).
    dy_q = gemm.operand(dy_TxN, key=dgrad_key)
    w_t_q = weight.dgrad if weight.dgrad is not None else transpose_2d(weight.fprop)
    dx_TxK = gemm.matmul(dy_q, w_t_q)

    # wgrad: dW = dY^T X, contracting over T: both operands (RHT'd) quantized along T.
    dy_t_q = gemm.operand(dy_TxN, transpose=True, rht=options.rht, key=wgrad_key)
    x_t_q = gemm.operand(x_TxK, transpose=True, rht=options.rht)
    dw_NxK = gemm.matmul(dy_t_q, x_t_q)

    return dx_TxK.astype(x_TxK.dtype), dw_NxK.astype(w_NxK.dtype), None, None, None


_nvfp4_dot.defvjp(_nvfp4_dot_fwd, _nvfp4_dot_bwd)


@dataclasses.dataclass(frozen=True)
class _Gemms:
    """How this trace quantizes (fused Pallas kernels or XLA ops) and multiplies (packed arrays
    and the native FP4 GEMM, or operands and the BF16 emulation); see the module docstring."""

    pallas: bool
    native: bool
    packed_matmul: PackedMatmul = NATIVE_MATMUL

    @classmethod
    def of(cls, options: NVFP4Options) -> _Gemms:
        quantizer, gemm = resolve_backend(options.quantizer, options.gemm)
        return cls(pallas=quantizer == "pallas", native=gemm == "native", packed_matmul=options.packed_matmul)

    def operand(
        self,
        x_RxC: jax.Array,
        *,
        transpose: bool = False,
        rht: bool = False,
        block: str = "1d",
        global_amax: jax.Array | None = None,
        key: jax.Array | None = None,
    ):
        """The GEMM operand of op = [rht16 of] (x.T if transpose else x), quantized along its last
        axis; stochastic rounding with `key` when given; `global_amax` None: op's own amax."""
        rounding = "rne" if key is None else "stochastic"
        if self.pallas:
            op_shape = x_RxC.shape[::-1] if transpose else x_RxC.shape
            if global_amax is None:  # max|op|: a transpose does not change it, an RHT does
                global_amax = tensor_amax(rht16(x_RxC, axis=0 if transpose else -1) if rht else x_RxC)
            bits = None if key is None else stochastic_bits(key, op_shape)
            return fused_quantize(
                x_RxC,
                global_amax,
                mode="packed" if self.native else "operand",
                rounding=rounding,
                bits=bits,
                block=block,
                rht=rht,
                transpose=transpose,
            )
        op = x_RxC.T if transpose else x_RxC
        if rht:
            op = rht16(op, axis=-1)
        quantize = quantize_nvfp4 if self.native else nvfp4_operand
        return quantize(op, block=block, global_amax=global_amax, rounding=rounding, key=key)

    def matmul(self, a, b):
        """`a @ b.T` of two operands from `operand`, fp32."""
        return self.packed_matmul(a, b) if self.native else nvfp4_operand_matmul(a, b)
