"""Equivalent scaling before quantization (`export --equalize awq|smoothquant`).

    found = equalize(config, source.tensors, quants, ids_SxL, method="awq", block="1d", offload="auto")
    tensors = EqualizedSource(source.tensors, found.scales)   # what the export quantizes and writes

A per-input-channel s is folded into each site's consumers and producer (the same function); AWQ
scores each consumer in its own format (`quants`: a mixed plan's differ). The export is refused
unless the mean KL(original || folded) is at most `FOLD_KL_LIMIT` nats.
Design notes: docs/design/equalize.md.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import math
import os
import tempfile
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool import memory, progress
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export.simulate import quantize_input, served_linear
from nvfp4tool.families import Fold, folds, fused_group, layer_index
from nvfp4tool.formats import FP8_GRANULARITY
from nvfp4tool.model.fold import EqualizedSource, FoldScale, site_key
from nvfp4tool.model.layerwise import LayerwiseModel, layer_modules
from nvfp4tool.model.linear import Plain
from nvfp4tool.model.logit_spool import LogitSpool
from nvfp4tool.model.weights import model_from_tensors
from nvfp4tool.numerics import dense, fake_quantize_fp8, fake_quantize_nvfp4
from nvfp4tool.numerics.constants import FP8_BLOCK
from nvfp4tool.recipes.precision import GEMM_INPUT_DTYPE
from nvfp4tool.records.export import EqualizationRecord, FoldRecord

METHODS = ("none", "awq", "smoothquant")
AWQ_ALPHAS = tuple(i / 10 for i in range(11))  # ModelOpt awq_lite: alpha_step 0.1 over [0, 1]
SMOOTHQUANT_ALPHA = 0.5  # SmoothQuant's migration strength (the paper's default)
SCALE_RANGE = (1e-4, 1e4)  # AWQ's clip of s
CHECK_WINDOWS = 4  # calibration windows the folded model is checked on
CHECK_DTYPE = jnp.float32  # ... computing in fp32, as validate runs every model
# The folded model stores its norms / producer rows / router divided or multiplied by s and
# rounded to BF16 again: on SmolLM2-135M (SmoothQuant, 4 x 256 tokens of shakespeare train.txt,
# fp32 compute) that moves the logits by a mean KL of 1.2e-4 nats (top-1 99.3%); the same model
# computing in BF16 instead of fp32 moves them by 1.1e-3. A wrong fold is far above the limit.
FOLD_KL_LIMIT = 2e-3
# the formats AWQ's objective quantizes a consumer in (its index in an _Errors aux: "kind")
OBJECTIVES = ("nvfp4", "nvfp4-weight-only", "fp8", "fp8-block")


@dataclasses.dataclass(frozen=True)
class Equalization:
    """The scales of every equalized site and the record of how they were found and checked."""

    scales: tuple[FoldScale, ...]
    record: EqualizationRecord


def equalize(
    config: ModelConfig,
    source,
    quants: Mapping[str, str],
    ids_SxL: np.ndarray,
    *,
    method: str,
    block: str,
    offload: str,
) -> Equalization:
    """The scales of `method` for every site whose consumers are all quantized (`quants`: quantized
    linear -> its quant, one of `OBJECTIVES`; a site with a BF16 consumer keeps s = 1), checked
    (see the module docstring); NVFP4ToolError when the folded model is not the original."""
    from nvfp4tool.export.calibrate import BATCH, open_bf16_model

    sites = [f for f in folds(config) if all(c in quants for c in f.consumers)]
    if not sites:
        raise NVFP4ToolError(f"--equalize {method}: no site to equalize (every site has a consumer kept in BF16)")
    model = open_bf16_model(config, source, seq_len=ids_SxL.shape[1], offload=offload, what=f"--equalize {method}")
    stats = _statistics(model, config, sites, ids_SxL, BATCH)
    if method == "smoothquant":
        scales = tuple(_smoothquant(site, stats[site.consumers[0]], source) for site in sites)
    else:
        scales = _awq(model, config, sites, stats, source, ids_SxL, BATCH, quants=quants, block=block)
    del model
    memory.release()
    kl, top1 = _check_folded(config, source, scales, ids_SxL[:CHECK_WINDOWS], offload)
    reductions = [1.0 - f.error / f.rtn_error for f in scales if f.error is not None and f.rtn_error]
    searched = (
        f", output error on the calibration inputs {100 * float(np.mean(reductions)):.1f}% below "
        f"s = 1 (mean over sites)"
        if reductions
        else ""
    )
    progress.info(
        f"--equalize {method}: {len(scales)} sites{searched}; the folded BF16 model vs the original on "
        f"{min(CHECK_WINDOWS, len(ids_SxL))} calibration windows: KL mean {kl:.3g} nats, "
        f"top-1 {100 * top1:.2f}%"
    )
    if not kl <= FOLD_KL_LIMIT:  # also refuses nan
        raise NVFP4ToolError(
            f"--equalize {method}: the folded model is not the original (KL mean {kl:.3g} nats "
            f"> {FOLD_KL_LIMIT:g} on the calibration windows); nothing written"
        )
    return Equalization(scales=scales, record=_record(method, scales, kl, top1, min(CHECK_WINDOWS, len(ids_SxL))))


# ------------------------------------------------------------------------------------------
# the passes


@dataclasses.dataclass(frozen=True)
class _Stats:
    """Tap: the plain BF16 GEMM; the linears in `names` (block-program names) record their input's
    per-channel [sum |x|, max |x|] (fp32) and its token count."""

    names: frozenset[str]

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        y = dense(x, w_NxK, b_N, compute_dtype=GEMM_INPUT_DTYPE)
        if name not in self.names:
            return y, None
        a_TxK = jnp.abs(x.reshape(-1, x.shape[-1]).astype(jnp.float32))
        return y, (jnp.stack([jnp.sum(a_TxK, axis=0), jnp.max(a_TxK, axis=0)]), a_TxK.shape[0])


@dataclasses.dataclass(frozen=True)
class _Errors:
    """Tap: the plain BF16 GEMM; a linear with candidates in its layer's aux ({"s": [A, K] scales,
    "amax": [A] its fused group's weight amax with each, "kind": its format's index in
    `OBJECTIVES`}) records the summed squared error [A] of its quantized output for each candidate
    against the BF16 GEMM's, weight and input quantized as its format serves them (NVFP4 W4A4: both
    in NVFP4, the weight against the group amax; W4A16: the weight only; FP8: both per tensor;
    fp8-block: the weight per 128x128 block, the input per token per 128 columns, dynamic)."""

    block: str

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        y = dense(x, w_NxK, b_N, compute_dtype=GEMM_INPUT_DTYPE)
        if aux is None or name not in aux:
            return y, None
        x_TxK = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        w = w_NxK.astype(jnp.float32)
        y_ref = jnp.matmul(x_TxK, w.T, precision=jax.lax.Precision.HIGHEST)

        def nvfp4(w_s, x_s, amax):
            return fake_quantize_nvfp4(w_s, block=self.block, global_amax=amax), fake_quantize_nvfp4(x_s)

        def weight_only(w_s, x_s, amax):
            return fake_quantize_nvfp4(w_s, block=self.block, global_amax=amax), x_s

        def fp8(w_s, x_s, amax):
            return fake_quantize_fp8(w_s), fake_quantize_fp8(x_s)

        def fp8_block(w_s, x_s, amax):  # the export's weight quantizer, the served input quantizer
            w_q = fake_quantize_fp8(w_s, granularity=FP8_GRANULARITY["fp8-block"])
            return w_q, quantize_input("fp8-block", None, x_s, name)

        # jax.lax.switch traces every branch: fp8-block's input groups need K a multiple of 128,
        # which every fp8-block linear has (make_plan), so a linear with another K never takes it
        blocks_fit = x_TxK.shape[-1] % FP8_BLOCK == 0

        def error(candidate):
            s_K, amax = candidate
            branches = (nvfp4, weight_only, fp8, fp8_block if blocks_fit else fp8)  # in OBJECTIVES' order
            w_q, x_q = jax.lax.switch(aux[name]["kind"], branches, w * s_K[None, :], x_TxK / s_K[None, :], amax)
            diff = jnp.matmul(x_q, w_q.T, precision=jax.lax.Precision.HIGHEST) - y_ref
            return jnp.sum(diff * diff)

        return y, jax.lax.map(error, (aux[name]["s"], aux[name]["amax"]))


def _statistics(model, config: ModelConfig, sites: list[Fold], ids_SxL: np.ndarray, batch: int):
    """First consumer of each site -> (mean |x| [K], max |x| [K]) over the calibration tokens."""
    first = [site.consumers[0] for site in sites]
    names = frozenset(n for i in range(config.num_layers) for n in layer_modules(first, i))
    sums: dict[str, list] = {}

    def record(name: str, value) -> None:
        (stat, count) = value
        stat = np.asarray(stat, np.float64)
        if name in sums:
            sums[name][0] += stat[0]
            sums[name][1] = np.maximum(sums[name][1], stat[1])
            sums[name][2] += int(count)
        else:
            sums[name] = [stat[0].copy(), stat[1].copy(), int(count)]

    for _ in model.logits(
        ids_SxL, batch, tap=_Stats(names), on_record=record, label="equalize: statistics", all_experts=True
    ):
        pass
    missing = [n for n in first if n not in sums]
    if missing:
        raise NVFP4ToolError(f"--equalize: {missing[0]} was never called by the model")
    from nvfp4tool.export.calibrate import check_calibrated

    for name in first:  # a zero input has no scale to choose (W4A4's calibration refuses it the same way)
        check_calibrated(name, float(np.max(sums[name][1])))
    return {n: (sums[n][0] / sums[n][2], sums[n][1]) for n in first}


def _producer_space(site: Fold, per_channel: np.ndarray, reduce) -> np.ndarray:
    """A consumer-channel statistic in the producer's channels (GQA: reduced over the query heads)."""
    if site.expand is None:
        return per_channel
    groups, repeat, width = site.expand
    return reduce(per_channel.reshape(groups, repeat, width), axis=1).reshape(-1)


def _column_max(source, modules: Sequence[str]) -> np.ndarray:
    """max |w| of each input column over the weights of `modules`."""
    return np.max([np.max(np.abs(np.asarray(source.get(f"{m}.weight"), np.float32)), axis=0) for m in modules], axis=0)


def _smoothquant(site: Fold, stats, source) -> FoldScale:
    x_max = _producer_space(site, stats[1], np.max)
    w_max = _producer_space(site, _column_max(source, site.consumers), np.max)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = x_max**SMOOTHQUANT_ALPHA / w_max ** (1.0 - SMOOTHQUANT_ALPHA)
    s = np.where((x_max > 0) & (w_max > 0) & np.isfinite(s), s, 1.0)
    return FoldScale(fold=site, s=np.clip(s, *SCALE_RANGE).astype(np.float32), alpha=SMOOTHQUANT_ALPHA)


def awq_candidates(mean_abs: np.ndarray, alphas: Sequence[float] = AWQ_ALPHAS) -> np.ndarray:
    """AWQ's candidate scales [A, C] from the per-channel mean |x|: mean|x|^alpha, clipped, over
    sqrt(max * min) (a channel never seen stays at the clip's floor before the normalisation)."""
    base = np.maximum(np.asarray(mean_abs, np.float64), SCALE_RANGE[0])
    rows = []
    for alpha in alphas:
        s = np.clip(base**alpha, *SCALE_RANGE)
        rows.append(s / math.sqrt(float(s.max()) * float(s.min())))
    return np.asarray(rows, np.float32)


def _awq(
    model,
    config: ModelConfig,
    sites: list[Fold],
    stats,
    source,
    ids_SxL: np.ndarray,
    batch: int,
    *,
    quants: Mapping[str, str],
    block: str,
) -> tuple[FoldScale, ...]:
    candidates = {
        site.consumers[0]: awq_candidates(_producer_space(site, stats[site.consumers[0]][0], np.mean)) for site in sites
    }
    by_layer: dict[int, list[Fold]] = {}
    for site in sites:
        by_layer.setdefault(layer_index(site.consumers[0]), []).append(site)

    @functools.lru_cache(maxsize=2)
    def aux(layer: int | None):
        if layer is None or layer not in by_layer:
            return None
        result = {}
        for site in by_layer[layer]:
            s_AxC = candidates[site.consumers[0]]
            s_AxK = np.stack([FoldScale(site, s, 0.0).consumer_scale() for s in s_AxC])
            col_max = {
                m: np.max(np.abs(np.asarray(source.get(f"{m}.weight"), np.float32)), axis=0) for m in site.consumers
            }
            group_amax = {}
            for m in site.consumers:  # a fused group shares the global amax of its scaled members
                g = fused_group(m)
                amax = np.max(col_max[m][None, :] * s_AxK, axis=1)
                group_amax[g] = np.maximum(group_amax.get(g, 0.0), amax)
            names = layer_modules(site.consumers, layer)
            for program_name, m in names.items():
                result[program_name] = {
                    "s": jnp.asarray(s_AxK),
                    "amax": jnp.asarray(group_amax[fused_group(m)], jnp.float32),
                    "kind": jnp.int32(OBJECTIVES.index(quants[m])),
                }
        return result

    errors: dict[str, np.ndarray] = {}

    def record(name: str, value) -> None:
        errors[name] = errors.get(name, 0.0) + np.asarray(value, np.float64)

    for _ in model.logits(
        ids_SxL,
        batch,
        tap=_Errors(block=block),
        aux=aux,
        on_record=record,
        label=f"equalize: AWQ ({len(AWQ_ALPHAS)} scales per site)",
        all_experts=True,
    ):
        pass
    result = []
    for site in sites:
        missing = [c for c in site.consumers if c not in errors]
        if missing:
            raise NVFP4ToolError(f"--equalize awq: {missing[0]} was never called by the model")
        total = np.sum([errors[c] for c in site.consumers], axis=0)
        if not np.isfinite(total).all():
            raise NVFP4ToolError(f"--equalize awq: non-finite output error at {site_key(site)}")
        best = int(np.argmin(total))  # the first of equal errors: the smallest alpha
        result.append(
            FoldScale(
                fold=site,
                s=candidates[site.consumers[0]][best],
                alpha=AWQ_ALPHAS[best],
                error=float(total[best]),
                rtn_error=float(total[0]),
            )
        )
    return tuple(result)


def _check_folded(config: ModelConfig, source, scales, ids_SxL: np.ndarray, offload: str) -> tuple[float, float]:
    """(mean KL(original || folded), top-1 agreement) of the two models as stored in BF16, run as
    validate runs a BF16 model (fp32 compute: BF16 arithmetic alone moves SmolLM2's logits by a KL
    of ~1e-3, which would hide the fold's own error)."""
    from nvfp4tool.export.calibrate import BATCH, _Cast
    from nvfp4tool.numerics.metrics import token_kl, top1_agree

    def opened(tensors, what: str) -> LayerwiseModel:
        weights = 2 * sum(int(np.prod(s)) for s in config.expected_tensor_shapes().values())
        return LayerwiseModel.open(
            config,
            build=lambda mesh: model_from_tensors(  # held and streamed in BF16
                config, tensors, dtype=GEMM_INPUT_DTYPE, compute_dtype=CHECK_DTYPE, mesh=mesh
            ),
            source=_Cast(tensors),
            offload=offload,
            weights=weights,
            working=4 * BATCH * ids_SxL.shape[1] * config.vocab_size * 3,
            what=f"--equalize check: {what}",
            compute_dtype=CHECK_DTYPE,
        )

    tap = Plain(served_linear)
    with tempfile.TemporaryDirectory(prefix="nvfp4tool-equalize-") as scratch:
        spool = LogitSpool(os.path.join(scratch, "original.f32"), ids_SxL.shape, config.vocab_size)
        model = opened(source, "the original")
        for start, logits in model.logits(ids_SxL, BATCH, tap=tap, label="equalize: original"):
            spool.write(start, np.asarray(logits))
        del model
        memory.release()
        folded = opened(EqualizedSource(source, scales), "the folded model")
        kl, agree = [], []
        for start, logits in folded.logits(ids_SxL, BATCH, tap=tap, label="equalize: folded"):
            ref = spool.read(start, len(logits))
            kl.append(token_kl(ref, np.asarray(logits)).ravel())
            agree.append(top1_agree(ref, np.asarray(logits)).ravel())
        del folded
        memory.release()
    return float(np.concatenate(kl).mean()), float(np.concatenate(agree).mean())


def _record(method: str, scales: Sequence[FoldScale], kl: float, top1: float, windows: int) -> EqualizationRecord:
    sites = {}
    for found in scales:
        s = found.s.astype("<f4")
        reduction = None if found.error is None or not found.rtn_error else 1.0 - found.error / found.rtn_error
        sites[site_key(found.fold)] = FoldRecord(
            alpha=float(found.alpha),
            s_min=float(s.min()),
            s_max=float(s.max()),
            s_geomean=float(np.exp(np.mean(np.log(s.astype(np.float64))))),
            output_err_reduction=reduction,
            scales=base64.b64encode(s.tobytes()).decode("ascii"),
        )
    return EqualizationRecord(
        method=method,
        alphas=list(AWQ_ALPHAS) if method == "awq" else [SMOOTHQUANT_ALPHA],
        sites=sites,
        check_windows=windows,
        check_kl_mean=kl,
        check_top1=top1,
    )
