"""Which layers to keep in BF16 so that an export meets a KL target: the export's search on
validate's data (`export.auto_precision.upgrade_search`, one owner).

    found = sensitivity(inputs, kl_target=0.02)   # records.validation.Sensitivity
    found.keep_bf16        # fnmatch patterns for `nvfp4tool export --keep-bf16`
    keep_bf16_file_text(found)  # them as a keep-BF16 file (validate writes it: keep_bf16.txt)
    found.precision_map    # {linear: "bf16" | its format} for training (`bf16_patterns=` too)

A unit is what serving runs with one scheme (`families.scheme_group`); its ladder is (its format in
the export, "bf16"), priced by the export's stored bits (`_Size`).
Design notes: docs/design/validate.md.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

import jax.numpy as jnp
import numpy as np

from converters.tensor_source import tensor_bytes
from nvfp4tool import progress
from nvfp4tool.export.auto_precision import upgrade_search
from nvfp4tool.export.simulate import served_linear
from nvfp4tool.families import group_glob, scheme_group
from nvfp4tool.model.layerwise import LayerwiseModel, layer_modules
from nvfp4tool.model.transformer import real_name
from nvfp4tool.numerics import metrics
from nvfp4tool.records.export import AutoSearchStep
from nvfp4tool.records.validation import GroupHarm, SearchStep, Sensitivity

STEP_KIND = {"start": "start", "upgrade": "keep", "prune": "prune"}  # the export's step names -> validate's


def sensitivity(inputs, *, kl_target: float) -> Sensitivity:
    """The search (see the module docstring); `inputs` is the validation's (`runner.open_inputs`),
    after `run_validation` spooled the BF16 logits."""
    exported = inputs.nvfp4.exported
    quantized = list(exported.quantized)
    units: dict[str, list[str]] = {}
    for m in quantized:
        units.setdefault(scheme_group(m), []).append(m)
    mean_kl = _mixed_kl(inputs, quantized)
    size = _Size(exported, units)
    harm = {}
    with progress.task("sensitivity", total=len(units), unit="group") as task:
        for u in units:
            harm[u] = mean_kl(set(units) - {u})
            task.advance(description=u)
    order = sorted(units, key=lambda u: -harm[u])
    ladders = {u: (exported.quant_of(ms[0]), "bf16") for u, ms in units.items()}
    alone = {u: {ladders[u][0]: harm[u], "bf16": 0.0} for u in units}
    with progress.task("sensitivity search", total=None, unit="pass") as task:  # one per measured mix

        def measure(assign: dict[str, str]) -> float:
            kl = mean_kl({u for u, f in assign.items() if f == "bf16"})
            task.advance(fields={"kl": f"{kl:.4g}"})
            return kl

        steps, _ = upgrade_search(
            size.weights, ladders, alone, measure, kl_target, margin=1.0, bits_of=size.unit_bits, label="sensitivity"
        )
    trajectory = _trajectory(steps, size)
    kept = trajectory[-1].kept
    return Sensitivity(
        kl_target=kl_target,
        met=trajectory[-1].kl_mean <= kl_target,
        harm=[GroupHarm(group=u, kl_mean_alone=harm[u]) for u in order],
        trajectory=trajectory,
        keep_bf16=[p for u in kept for p in unit_patterns(u, units[u])],
        precision_map={m: ("bf16" if scheme_group(m) in kept else exported.quant_of(m)) for m in quantized},
    )


def unit_patterns(unit: str, members: list[str]) -> list[str]:
    """fnmatch patterns matching exactly the members of a unit: its fused group's pattern, or each
    member of a MoE layer's experts (one pattern could not name them all)."""
    return [group_glob(unit, members)] if unit.rpartition(".")[2] != "experts" else list(members)


def keep_bf16_file_text(found: Sensitivity) -> str:
    """The result as a keep-BF16 file (`export --keep-bf16-file`; the format is export.plan's): what
    was searched, how to use it, then the patterns. No path of this machine (push uploads it)."""
    from nvfp4tool.export.plan import format_keep_bf16_file

    first, last = found.trajectory[0].kl_mean, found.trajectory[-1].kl_mean
    return format_keep_bf16_file(
        found.keep_bf16,
        [
            "nvfp4tool validate --sensitivity: linear modules to keep in BF16 for a mean KL <= "
            f"{found.kl_target:g} nats",
            f"({'met' if found.met else 'NOT met'}: KL {first:.4g} with every group quantized, {last:.4g} keeping "
            f"these {len(found.keep_bf16)} group(s){found.trajectory[-1].size_text()})",
            "export: " + export_with_file("SOURCE", "keep_bf16.txt", found),
            f"train: bf16_patterns='{json.dumps(found.keep_bf16)}'",
        ],
    )


def export_with_file(source: str, keep_file: str, found: Sensitivity) -> str:
    """The short export command that realises the result from its keep-BF16 file (a mixed export's
    other formats come from the precision file it was made with: PRECISION_FILE, to fill in)."""
    mixed = len(set(found.precision_map.values()) - {"bf16"}) > 1
    command = f"nvfp4tool export {shlex.quote(source)} --out OUT --keep-bf16-file {shlex.quote(keep_file)}"
    return command + (" --precision-file PRECISION_FILE" if mixed else "")


# ------------------------------------------------------------------------------------------
# helpers


def _trajectory(steps: list[AutoSearchStep], size: _Size) -> list[SearchStep]:
    """The search's recorded steps as validate's: the units in BF16 after each (in the order they
    were kept; an upgrade step may keep several), its KL and size."""
    kept: list[str] = []
    trajectory = []
    for s in steps:
        for u, f in s.upgraded.items():
            if f == "bf16":
                kept.append(u)
            else:
                kept.remove(u)
        trajectory.append(SearchStep(kept=list(kept), kl_mean=s.measured_kl, step=STEP_KIND[s.step], **size.bits(kept)))
    return trajectory


def _mixed_kl(inputs, quantized: list[str]):
    """`mean_kl(kept)`: the mean KL on validate's windows, against its spooled BF16 logits, of the
    export as served with the units `kept` running their BF16 source weights (one model opened,
    held or streamed as `--offload` says; one compiled program for every choice: the flags are traced)."""
    exported, source = inputs.nvfp4.exported, inputs.source.tensors
    config = exported.config
    # the export as stored and, named apart in its layer, the BF16 weight of each quantized linear
    bf16 = {f"{m}.weight:bf16": tensor_bytes(source, f"{m}.weight") for m in quantized}
    need = inputs.footprint(config, {**exported.stored_tensor_bytes(), **bf16})
    model = LayerwiseModel.open(
        config,
        build=lambda mesh: exported.model(inputs.compute_dtype, mesh),
        source=exported,
        offload=inputs.options.offload,
        weights=need.weights,
        working=need.working,
        streamed=need.streamed,
        what=f"sensitivity: the export + BF16 weights ({need.weights / 1e9:.2f} GB)",
        compute_dtype=inputs.compute_dtype,
    )
    inputs.ran["sensitivity"] = "streamed" if model.streamed else "held"
    if model.streamed:
        weights = lambda layer: _layer_bf16(source, quantized, layer)  # noqa: E731
    else:
        held = {layer: _layer_bf16(source, quantized, layer) for layer in [None, *range(config.num_layers)]}
        weights = held.__getitem__

    def mean_kl(kept: set[str]) -> float:
        def aux(layer):
            bf16 = weights(layer)
            return {"bf16": bf16, "keep": {n: jnp.asarray(scheme_group(real_name(n, layer)) in kept) for n in bf16}}

        kl = [
            metrics.token_kl(inputs.reference_logits.read(start, len(logits)), np.asarray(logits)).ravel()
            for start, logits in model.logits(
                inputs.ids_SxL, inputs.options.batch_size, tap=_Mixed(), aux=aux, label="sensitivity"
            )
        ]
        return float(np.concatenate(kl).mean())

    return mean_kl


@dataclasses.dataclass(frozen=True)
class _Mixed:
    """Tap of the mixed model: the export as served, except that a module whose keep flag is set
    runs its BF16 source weight on its unquantized input."""

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        y_served = served_linear(x, w_NxK, b_N, name=name)
        if name not in aux["bf16"]:
            return y_served, None
        y_bf16 = served_linear(x, aux["bf16"][name], b_N, name=name)  # the plain BF16 GEMM
        return jnp.where(aux["keep"][name], y_bf16, y_served), None


class _Size:
    """The one bits rule of validate's search and of what it reports: each quantized module's stored
    bytes in the export (weight, block and global scales, input scale), its BF16 weight's 16 bits
    per weight when kept; the whole model's bits per parameter as it would be exported."""

    def __init__(self, exported, units: dict[str, list[str]]) -> None:
        shapes = exported.config.expected_tensor_shapes()
        count = {m: int(np.prod(shapes[f"{m}.weight"])) for ms in units.values() for m in ms}
        self._stored = {u: 8 * sum(exported.module_bytes(m) for m in ms) for u, ms in units.items()}
        self.weights = {u: sum(count[m] for m in ms) for u, ms in units.items()}  # unit -> its weights
        self._parameters = sum(int(np.prod(shape)) for shape in shapes.values())
        self._model_bits = 8 * exported.stored_bytes()

    def unit_bits(self, unit: str, fmt: str) -> float:
        """The bits `unit` takes: as the export stores it, or in BF16 ("bf16")."""
        return 16.0 * self.weights[unit] if fmt == "bf16" else float(self._stored[unit])

    def bits(self, kept: list[str]) -> dict[str, float]:
        extra = sum(self.unit_bits(u, "bf16") - self._stored[u] for u in kept)
        return {
            "bits_per_weight": (sum(self._stored.values()) + extra) / sum(self.weights.values()),
            "bits_per_parameter": (self._model_bits + extra) / self._parameters,
        }


def _layer_bf16(source, quantized: list[str], layer: int | None) -> dict[str, np.ndarray]:
    """{name as the block program sees it: BF16 source weight} of the quantized modules of `layer`
    (None: the LM head)."""
    return {name: source.get(f"{m}.weight") for name, m in layer_modules(quantized, layer).items()}
