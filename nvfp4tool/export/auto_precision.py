"""`export --auto-precision KL`: per-linear formats for the fewest bits whose measured KL meets KL.

    found = search_precision(source, plan, group_amax, input_amax, ids_SxL, options, block="1d", nvfp4=quantizer)
    found.text, found.rules   # the result as precision-file text, and its rules (`make_plan(rules=)`)
    found.record              # AutoPrecisionRecord (auto_precision.json); plot_search draws the PNG

A unit is what serving runs with one scheme (`families.scheme_group`). Its sensitivity to a format:
the calibration KL vs BF16 with only it in that format, run from its layer's cached BF16 input
(`LayerwiseModel.logits_from`). `upgrade_search` upgrades units up `LADDERS[--quant]` by KL saved
per bit until the additive prediction, times measured / predicted of the last measured mix, is
within MARGIN x KL; every mix is measured whole, as served (`BITS`: the bits rule), with the FP8
KV cache the export writes when it writes one (`kv_amax`; the BF16 reference without).
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool import memory, progress
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export.plan import ExportPlan
from nvfp4tool.export.quantizers import FP8_QUANTIZERS, WeightQuantizer, input_decode_scale, kv_decode_scales
from nvfp4tool.export.serving_folder import plain_copy
from nvfp4tool.export.simulate import (
    FP8BlockWeight,
    FP8Weight,
    NVFP4Weight,
    ServedKVTap,
    quantize_input,
    served_linear,
)
from nvfp4tool.families import group_glob, layer_index, scheme_group
from nvfp4tool.formats import BITS, NVFP4_QUANTS, STATIC_INPUT_QUANTS
from nvfp4tool.formats.precision_file import PrecisionRule, format_precision_file, parse_precision_text
from nvfp4tool.model.layerwise import LayerwiseModel, held_forward_bytes, layer_modules
from nvfp4tool.model.linear import Plain
from nvfp4tool.numerics import dense_widening, metrics
from nvfp4tool.numerics.constants import FP8_BLOCK
from nvfp4tool.records.export import AUTO_PRECISION_PNG, AutoPrecisionRecord, AutoSearchStep, UnitSensitivityRecord

# the formats a unit may take, cheapest first. W4A16 is no rung above W4A4: it costs the same
# 4.5 bits, so a bits budget cannot price it (every unit would take it first), and it changes the
# serving kernel (weight-only dequantize + BF16 GEMM, not the FP4 tensor-core GEMM a W4A4 export
# is chosen for); a W4A16 export is asked with --quant nvfp4-weight-only (its own ladder).
LADDERS = {
    "nvfp4": ("nvfp4", "fp8", "bf16"),
    "nvfp4-weight-only": ("nvfp4-weight-only", "fp8", "bf16"),
    "fp8": ("fp8", "bf16"),
    "fp8-block": ("fp8-block", "bf16"),
}
# bits per weight of a format (`formats.BITS`, the one rule check and the card count by): NVFP4 4.5,
# FP8 8, fp8-block 8 + 32/16384, BF16 16 (`BITS`, imported). Over the linears the base --quant quantizes.
MARGIN = 0.9  # the search stops at measured KL <= MARGIN x target (calibration KL under-reads held-out)
UNIFORM = ("nvfp4", "nvfp4-weight-only", "fp8")  # the uniform exports measured as points of the curve (+ the base)
BATCH = 8  # windows per forward
_INPUT_MODE = {"nvfp4": 1, "fp8": 2, "fp8-block": 3}  # the served input quantizer of a format (0: none)
KV_AUX = "kv_cache"  # the layer aux's entry of its FP8 KV-cache scales (no linear is named so)


@dataclasses.dataclass(frozen=True)
class AutoPrecision:
    """The search's result: the precision-file text and the record."""

    text: str
    record: AutoPrecisionRecord

    @property
    def rules(self) -> tuple[PrecisionRule, ...]:
        return parse_precision_text(self.text, "--auto-precision")


def search_precision(
    source,
    plan: ExportPlan,
    group_amax,
    input_amax: Mapping[str, float],
    ids_SxL: np.ndarray,
    options,
    *,
    block: str,
    nvfp4: WeightQuantizer,
    reference=None,
    kv_amax: Mapping[str, tuple[float, float]] | None = None,
) -> AutoPrecision:
    """The search over `plan.quantized` (the base --quant plan) on the search windows
    `ids_SxL` (see the module docstring); `input_amax` of every quantized linear; `nvfp4`: the
    export's NVFP4 quantizer (`quantizers.nvfp4_quantizer`: the scale search, or GPTQ's records),
    whose NVFP4 weights are measured and then written (FP8 / fp8-block: the writer's `FP8_QUANTIZERS`). `reference`: the
    tensors the KL is measured against (default `source.tensors`; --equalize: the unfolded source,
    as validate measures). `kv_amax` (--kv-cache fp8: attention -> calibrated (K, V) amax): every
    measured model runs the FP8 KV cache the export writes from them, the reference does not.
    NVFP4ToolError in one line when even every unit in BF16 misses the target."""
    start = time.perf_counter()
    target, base = float(options.auto_precision), options.quant
    ladder = LADDERS[base]
    config, tensors = source.config, source.tensors
    units: dict[str, list[str]] = {}
    for m in plan.quantized:
        units.setdefault(scheme_group(m), []).append(m)
    shapes = config.expected_tensor_shapes()
    weights = {u: sum(math.prod(shapes[f"{m}.weight"]) for m in ms) for u, ms in units.items()}
    # the reference: the source as stored (validate's); the mixes: its other tensors as the export writes them
    source_model = _open(config, reference or tensors, ids_SxL, options.offload, "the source")
    runs = source_model.logits(ids_SxL, BATCH, tap=Plain(served_linear), label="auto-precision: BF16 reference")
    reference = {s: np.asarray(logits) for s, logits in runs}
    del source_model, runs
    memory.release()
    written = _AsWritten(tensors, config.family_spec)
    variants = _Variants(tensors, written, plan, nvfp4, input_amax)
    model = _open(config, written, ids_SxL, options.offload, "the source as exported")
    tap, kv = _Assigned(), _KVCache(config, kv_amax or {})
    aux_of = lambda formats: lambda i: kv.aux(i, variants.aux(i, formats))  # noqa: E731
    inputs = model.layer_inputs(
        ids_SxL, BATCH, tap=tap, aux=aux_of({}), kv_tap=kv.tap, label="auto-precision: layer inputs"
    )

    def kl(layer: int, formats: Mapping[str, str], label: str) -> float:
        runs = model.logits_from(inputs, layer, tap=tap, aux=aux_of(formats), kv_tap=kv.tap, label=label)
        return float(np.concatenate([metrics.token_kl(reference[s], np.asarray(x)).ravel() for s, x in runs]).mean())

    def modules(assign: Mapping[str, str]) -> dict[str, str]:
        return {m: f for u, f in assign.items() for m in units[u]}

    # every unit in BF16: KL 0 by the rule (not run), or with the FP8 KV cache what it alone costs
    floor = kl(0, {}, "auto-precision: FP8 KV cache") if kv.tap else 0.0
    if floor > MARGIN * target:
        raise NVFP4ToolError(
            f"--auto-precision {target:g}: not met: the FP8 KV cache alone (every linear in BF16) gives "
            f"calibration KL {floor:.4g} > {MARGIN:g} x {target:g}; raise the target or export with --kv-cache none"
        )
    if kv.tap:
        progress.info(f"auto-precision: every linear in BF16 with the FP8 KV cache: calibration KL {floor:.4g}")
    alone = {u: {"bf16": floor} for u in units}
    candidates = [(u, f) for u in units for f in ladder[:-1]]
    sensitivity_start = time.perf_counter()
    with progress.task("auto-precision: sensitivity", total=len(candidates), unit="unit") as task:
        for u, f in candidates:  # in model order: one layer's variants at a time
            alone[u][f] = kl(layer_index(units[u][0]), {m: f for m in units[u]}, "auto-precision: sensitivity")
            task.advance(description=f"{u} {f}", fields={"kl": f"{alone[u][f]:.4g}"})
    rate = len(candidates) / max(time.perf_counter() - sensitivity_start, 1e-9)
    measure = lambda assign: kl(0, modules(assign), "auto-precision: mix")  # noqa: E731
    total = sum(weights.values())
    uniform = {}
    for f in UNIFORM + ((base,) if base not in UNIFORM else ()):
        found = measure(dict.fromkeys(units, f))
        uniform[f] = {"kl": found, "bits_per_weight": BITS[f]}
        progress.info(f"auto-precision: uniform {f}: calibration KL {found:.4g}, {BITS[f]:g} bits per weight")
    steps, assign = upgrade_search(
        weights, ladder, alone, measure, target, known={base: uniform[base]["kl"]}, floor=floor
    )
    last = steps[-1]
    met = last.measured_kl <= MARGIN * target
    samples, seq_len = ids_SxL.shape
    if not met:
        raise NVFP4ToolError(
            f"--auto-precision {target:g}: not met: calibration KL {last.measured_kl:.4g} > {MARGIN:g} x "
            f"{target:g} with every one of the {len(units)} units in {ladder[-1]} (a KL the model's BF16 "
            f"numerics{kv.words} alone give); raise the target"
        )
    text = precision_text(assign, units, base, target, last, (samples, seq_len), options.weight_rounding, kv.words)
    record = AutoPrecisionRecord(
        kl_target=target,
        margin=MARGIN,
        met=met,
        base=base,
        ladder=list(ladder),
        bits=dict(BITS),
        windows=[int(samples), int(seq_len)],
        units=[UnitSensitivityRecord(unit=u, modules=units[u], weights=weights[u], kl_alone=alone[u]) for u in units],
        steps=steps,
        uniform=uniform,
        precision_file=text,
        seconds=time.perf_counter() - start,
        units_per_second=rate,
        kv_cache="fp8" if kv.tap else None,
        kv_cache_kl=floor if kv.tap else None,
        weight_rounding=options.weight_rounding,
    )
    progress.info(
        f"auto-precision: calibration KL{kv.words} {last.measured_kl:.4g} <= {MARGIN:g} x {target:g} at "
        f"{last.bits_per_weight:.3f} bits per weight ({sum(1 for f in assign.values() if f != base)} of "
        f"{len(units)} units upgraded; {len(steps)} mixes measured; {total} weights)"
    )
    return AutoPrecision(text=text, record=record)


def upgrade_search(
    weights: Mapping[str, int],
    ladder: tuple[str, ...] | Mapping[str, tuple[str, ...]],
    alone: Mapping[str, Mapping[str, float]],
    measure: Callable[[dict[str, str]], float],
    kl_target: float,
    *,
    margin: float = MARGIN,
    known: Mapping[str, float] | None = None,
    bits_of: Callable[[str, str], float] | None = None,
    label: str = "auto-precision",
    floor: float = 0.0,
) -> tuple[list[AutoSearchStep], dict[str, str]]:
    """(the measured steps, the final {unit: format}): each unit starts at the first rung of its
    ladder (`ladder`: one for every unit, or {unit: its own}); while the last measured KL is above
    margin x target, units are upgraded (the most KL saved per added bit first, by
    `alone[unit][format]`) until the predicted sum times the correction (measured / predicted of the
    last mix) is within it, and the mix is measured (`measure`). Stops met or with every unit at the
    top of its ladder. `known`: {format: KL} of uniform mixes already measured. `bits_of(unit,
    format)`: the bits a unit takes in a format (default weights x `BITS`); `label` starts its lines.
    `floor`: the KL every unit at the top of its ladder measures (`alone[u][top]`; the FP8 KV
    cache's, else 0): each unit adds its KL above it (the prediction is floor + the sum of alone - floor)."""
    ladders = ladder if isinstance(ladder, Mapping) else dict.fromkeys(weights, tuple(ladder))
    bits_of = bits_of or (lambda u, f: weights[u] * BITS[f])
    goal, total = margin * kl_target, sum(weights.values())
    assign = {u: ladders[u][0] for u in weights}
    steps: list[AutoSearchStep] = []
    correction, upgraded = 1.0, {}

    def predicted(trial: Mapping[str, str]) -> float:
        return floor + sum(alone[u][trial[u]] - floor for u in weights)

    def step(changed: dict[str, str], kind: str, trial: dict[str, str]) -> AutoSearchStep:
        uniform = len(set(trial.values())) == 1 and next(iter(trial.values()))
        measured = (known or {}).get(uniform) if uniform else None
        measured = measure(dict(trial)) if measured is None else measured
        bits = sum(bits_of(u, trial[u]) for u in weights) / total
        found = AutoSearchStep(dict(changed), predicted(trial), correction, measured, bits, kind)
        progress.info(
            f"{label}: {kind} {len(steps)}: {len(changed)} unit(s) changed, predicted KL "
            f"{correction * found.predicted_kl:.4g}, measured {measured:.4g}, {bits:.3f} bits per weight"
        )
        return found

    while True:
        steps.append(step(upgraded, "upgrade" if steps else "start", assign))
        measured = steps[-1].measured_kl
        if measured <= goal or all(f == ladders[u][-1] for u, f in assign.items()):
            break
        correction = measured / predicted(assign) if predicted(assign) > 0 else math.inf
        upgraded = {}
        while not upgraded or correction * predicted(assign) > goal:
            choice = _best_upgrade(assign, ladders, alone, bits_of)
            if choice is None:
                break
            assign[choice[0]] = upgraded[choice[0]] = choice[1]
    if steps[-1].measured_kl > goal:
        return steps, assign

    # prune: an upgrade the last round made in bulk may be unneeded (the KLs do not add); each upgraded
    # unit, the most bits saved per predicted KL added first, goes one rung down if the mix still meets it
    def lower(u: str) -> str:
        return ladders[u][ladders[u].index(assign[u]) - 1]

    def saving(u: str) -> float:
        return (bits_of(u, assign[u]) - bits_of(u, lower(u))) / max(alone[u][lower(u)] - alone[u][assign[u]], 1e-30)

    def without(u: str) -> AutoSearchStep:
        return step({u: lower(u)}, "prune", {**assign, u: lower(u)})

    for u, trial in prune_pass(
        sorted((u for u in assign if assign[u] != ladders[u][0]), key=lambda u: -saving(u)),
        without,
        lambda t: t.measured_kl <= goal,
    ):
        assign.update(trial.upgraded)
        steps.append(trial)
    return steps, assign


def prune_pass(candidates, trial_without, meets) -> Iterator[tuple]:
    """The prune rule of `upgrade_search` (the one search, `validate --sensitivity`'s too): each
    candidate in turn, the measured `trial_without(candidate)` (made from the state as pruned so far)
    is kept, and yielded as (candidate, trial) for the caller to apply, when `meets(trial)`."""
    for candidate in candidates:
        trial = trial_without(candidate)
        if meets(trial):
            yield candidate, trial


def _best_upgrade(assign, ladders, alone, bits_of) -> tuple[str, str] | None:
    """(unit, format) of the upgrade saving the most predicted KL per added bit (one saving KL
    before one that does not); None when every unit is at the top of its ladder."""
    best, key = None, None
    for u, now in assign.items():
        for f in ladders[u][ladders[u].index(now) + 1 :]:
            gain = alone[u][now] - alone[u][f]
            cost = bits_of(u, f) - bits_of(u, now)
            k = (gain > 0, gain / cost if cost > 0 else math.inf, gain)
            if key is None or k > key:
                best, key = (u, f), k
    return best


def precision_text(
    assign, units, base: str, target: float, last: AutoSearchStep, windows, weight_rounding: str = "rtn", kv: str = ""
) -> str:
    """The result as a precision file (`format_precision_file`): a comment saying what was searched
    (`kv`: " with the FP8 KV cache" when it ran with it), then one line per upgraded unit (its fused
    group's pattern, or its modules)."""
    rules = []
    for u, f in assign.items():
        if f == base:
            continue
        pattern = group_glob(u, units[u]) if u.rpartition(".")[2] != "experts" else None
        rules += [PrecisionRule(pattern, f)] if pattern else [PrecisionRule(m, f) for m in units[u]]
    comments = [
        f"nvfp4tool export --auto-precision {target:g} (--quant {base}, --weight-rounding {weight_rounding}): "
        f"calibration KL{kv} "
        f"{last.measured_kl:.4g} <= {MARGIN:g} x target on {windows[0]} x {windows[1]} tokens, "
        f"{last.bits_per_weight:.3f} bits per weight over the quantized linears",
        f"modules no line names take --quant {base}",
    ]
    return format_precision_file(rules, comments)


def plot_search(record: AutoPrecisionRecord, path: str) -> None:
    """The KL-vs-bits curve: the search's measured steps as a line, the uniform formats as points,
    the target and margin x target as lines (PNG at `path`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    climb = [s for s in record.steps if s.step != "prune"]
    ax.plot(
        [s.bits_per_weight for s in climb],
        [s.measured_kl for s in climb],
        "o-",
        label=f"--auto-precision search ({record.base} base, {record.weight_rounding.upper()} weights)",
    )
    pruned = [s for s in record.steps if s.step == "prune"]
    if pruned:
        ax.plot([s.bits_per_weight for s in pruned], [s.measured_kl for s in pruned], "x", label="prune steps")
    last = record.steps[-1]
    ax.plot([last.bits_per_weight], [last.measured_kl], "*", ms=14, label="result")
    names = {
        "nvfp4": "NVFP4 W4A4",
        "nvfp4-weight-only": "NVFP4 W4A16",
        "fp8": "FP8 W8A8",
        "fp8-block": "FP8 block W8A8",
    }
    rounded = f" ({record.weight_rounding.upper()})" if record.weight_rounding != "rtn" else ""
    for f, point in record.uniform.items():
        how = rounded if f in ("nvfp4", "nvfp4-weight-only") else ""
        ax.plot([point["bits_per_weight"]], [point["kl"]], "s", label=f"uniform {names.get(f, f)}{how}")
    ax.axhline(record.kl_target, color="k", lw=0.8, label=f"target {record.kl_target:g}")
    ax.axhline(record.margin * record.kl_target, color="k", ls="--", lw=0.8, label=f"{record.margin:g} x target")
    if all(s.measured_kl > 0 for s in record.steps) and all(p["kl"] > 0 for p in record.uniform.values()):
        ax.set_yscale("log")
    ax.set_xlabel("bits per weight over the quantized linears (NVFP4 4.5, FP8 8, fp8-block 8.002, BF16 16)")
    ax.set_ylabel("mean KL vs BF16 (nats), the search windows of --calib-data")
    kv = ", FP8 KV cache" if record.kv_cache else ""
    ax.set_title(f"auto-precision on {record.windows[0]} x {record.windows[1]} calibration tokens{kv}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_search(found: AutoPrecision, folder: str) -> None:
    """The record (auto_precision.json) and its curve (auto_precision.png) into the export `folder`."""
    found.record.write(folder)
    plot_search(found.record, os.path.join(folder, AUTO_PRECISION_PNG))


# ------------------------------------------------------------------------------------------
# helpers


@dataclasses.dataclass(frozen=True)
class _Assigned:
    """Tap of a mix: a linear named in the layer's aux runs its entry (the weight decoded as its
    format stores it, fp32, and its format's served input quantizer, `_INPUT_MODE`), as served;
    any other (lm_head, a kept BF16 linear) its weight as it is."""

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        entry = (aux or {}).get(name)
        if entry is None:
            return served_linear(x, w_NxK, b_N, name=name), None
        scale = entry["scale"]
        # jax.lax.switch traces every branch: fp8-block's input groups need K a multiple of 128,
        # which every fp8-block linear has (make_plan), so a linear with another K never takes it
        blocks_fit = x.shape[-1] % FP8_BLOCK == 0
        x = jax.lax.switch(
            entry["mode"],
            (
                lambda x: x,
                lambda x: quantize_input("nvfp4", scale, x, name),
                lambda x: quantize_input("fp8", scale, x, name),
                (lambda x: quantize_input("fp8-block", None, x, name)) if blocks_fit else (lambda x: x),
            ),
            x,
        )
        return dense_widening(x, entry["w"], b_N, widen_rows=lambda w, start, stop: w[start:stop]), None


class _Variants:
    """Each quantized linear's aux entry in a format: decoded as the export would store it (the
    writer's quantizers, its group's amax), one layer's quantized variants cached at a time."""

    def __init__(self, tensors, written, plan: ExportPlan, nvfp4: WeightQuantizer, input_amax):
        self._tensors, self._written, self._quantized = tensors, written, plan.quantized
        self._nvfp4 = nvfp4
        self._input_amax = {m: max(input_amax[x] for x in plan.groups[plan.group_of(m)]) for m in plan.quantized}
        self._layer: int | None = None
        self._cache: dict[tuple[str, str], jax.Array] = {}

    def aux(self, layer: int | None, formats: Mapping[str, str]) -> dict:
        """{name as the block sees it: entry} of layer `layer`'s quantized linears, each in
        formats.get(module, "bf16"); {} for the LM head (`layer` None)."""
        if layer is None:
            return {}
        return {
            n: self._entry(layer, m, formats.get(m, "bf16")) for n, m in layer_modules(self._quantized, layer).items()
        }

    def _entry(self, layer: int, module: str, fmt: str) -> dict:
        static = fmt in STATIC_INPUT_QUANTS  # W4A4, FP8 per tensor: the calibrated input scale
        scale = input_decode_scale(self._input_amax[module], fmt) if static else np.float32(1.0)
        entry = {"mode": jnp.int32(_INPUT_MODE.get(fmt, 0)), "scale": jnp.asarray(scale, jnp.float32)}
        if fmt == "bf16":
            return {**entry, "w": jnp.asarray(self._written.get(f"{module}.weight"), jnp.float32)}
        if layer != self._layer:
            self._layer, self._cache = layer, {}
        kind = "nvfp4" if fmt in NVFP4_QUANTS else fmt  # W4A4 and W4A16 store the same codes
        if (module, kind) not in self._cache:
            w = self._tensors.get(f"{module}.weight")
            r = FP8_QUANTIZERS.get(kind, self._nvfp4).quantize(module, w).roles  # the writer's quantizers
            if kind == "fp8":
                stored = FP8Weight(data=r["weight"], scale=r["weight_global"], input_scale=None)
            elif kind == "fp8-block":
                stored = FP8BlockWeight(data=r["weight"], scale=r["block_scale"])
            else:
                stored = NVFP4Weight(r["weight"], r["block_scale"], r["weight_global"], None)
            self._cache[(module, kind)] = stored.dequantize()
        return {**entry, "w": self._cache[(module, kind)]}


class _KVCache:
    """The FP8 KV cache a mix runs (--kv-cache fp8): each attention layer's (K, V) decode scales as
    the export writes them from the calibrated amax (`quantizers.kv_decode_scales`), carried in the
    layer's aux beside its linears' entries (`ServedKVTap(key=KV_AUX)`); none without `kv_amax`."""

    def __init__(self, config, kv_amax: Mapping[str, tuple[float, float]]) -> None:
        attention = {i: config.modules.attention(i) for i in range(config.num_layers)}
        self._scales = {i: kv_decode_scales(kv_amax[a]) for i, a in attention.items() if a is not None and kv_amax}
        self.tap = ServedKVTap(key=KV_AUX) if kv_amax else None
        self.words = " with the FP8 KV cache" if kv_amax else ""  # how lines say it

    def aux(self, layer: int | None, entries: dict) -> dict:
        """Layer `layer`'s aux: its linears' `entries`, and its K / V scales where it has attention."""
        if layer not in self._scales:
            return entries
        return {**entries, KV_AUX: tuple(jnp.asarray(s) for s in self._scales[layer])}


class _AsWritten:
    """The source's tensors as the export writes the unquantized ones (`serving_folder.plain_copy`:
    BF16 for a float), what a mix runs besides its searched linears."""

    def __init__(self, tensors, family) -> None:
        self._tensors, self._family = tensors, family

    def get(self, name: str) -> np.ndarray:
        return plain_copy(self._tensors, name, self._family)

    def __getattr__(self, name: str):
        return getattr(self._tensors, name)


def _open(config, tensors, ids_SxL: np.ndarray, offload: str, what: str) -> LayerwiseModel:
    """`tensors` in their dtype, computing in fp32 as validate's models do; the working set counts
    the cached layer inputs and the reference logits."""
    from nvfp4tool.model.weights import model_from_tensors

    samples, seq_len = ids_SxL.shape
    shapes = config.expected_tensor_shapes().values()
    stored = 2 * sum(math.prod(s) for s in shapes)
    cached = 4 * samples * seq_len * (config.num_layers * config.hidden_size + config.vocab_size)
    return LayerwiseModel.open(
        config,
        build=lambda mesh: model_from_tensors(config, tensors, dtype=None, compute_dtype=jnp.float32, mesh=mesh),
        source=tensors,
        offload=offload,
        weights=stored,
        working=held_forward_bytes(config, BATCH, seq_len) + cached,
        what=f"auto-precision: {what} ({stored / 1e9:.2f} GB)",
        compute_dtype=jnp.float32,
    )
