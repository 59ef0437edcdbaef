"""Which layers to keep in BF16 so that the NVFP4 export meets a KL target (greedy search).

    found = sensitivity(inputs, kl_target=0.02)   # records.validation.Sensitivity
    found.keep_bf16        # fnmatch patterns for `nvfp4tool export --keep-bf16`
    keep_bf16_file_text(found)  # them as a keep-BF16 file (validate writes it: keep_bf16.txt)
    found.precision_map    # {linear: "bf16" | "nvfp4"} for training (`bf16_patterns=` too)

The unit is a fused group; the prune rule is export's (`auto_precision.prune_pass`, one owner).
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
from nvfp4tool.export.auto_precision import prune_pass
from nvfp4tool.export.simulate import served_linear
from nvfp4tool.families import fused_group, group_glob
from nvfp4tool.model.layerwise import LayerwiseModel, layer_modules
from nvfp4tool.model.transformer import real_name
from nvfp4tool.numerics import metrics
from nvfp4tool.records.validation import GroupHarm, SearchStep, Sensitivity


def sensitivity(inputs, *, kl_target: float) -> Sensitivity:
    """The greedy search (see the module docstring); `inputs` is the validation's
    (`runner.open_inputs`), after `run_validation` spooled the BF16 logits."""
    exported, source = inputs.nvfp4.exported, inputs.source.tensors
    quantized = list(exported.quantized)
    groups: dict[str, list[str]] = {}
    for m in quantized:
        groups.setdefault(fused_group(m), []).append(m)
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
            return {"bf16": bf16, "keep": {n: jnp.asarray(fused_group(real_name(n, layer)) in kept) for n in bf16}}

        kl = [
            metrics.token_kl(inputs.reference_logits.read(start, len(logits)), np.asarray(logits)).ravel()
            for start, logits in model.logits(
                inputs.ids_SxL, inputs.options.batch_size, tap=_Mixed(), aux=aux, label="sensitivity"
            )
        ]
        return float(np.concatenate(kl).mean())

    names = list(groups)
    size = _Size(exported, source, groups)
    harm = {}
    with progress.task("sensitivity", total=len(names), unit="group") as task:
        for g in names:
            harm[g] = mean_kl(set(names) - {g})
            task.advance(description=g)
    order = sorted(names, key=lambda g: -harm[g])

    trajectory = search(order, harm, lambda kept: mean_kl(set(kept)), size.bits, kl_target)
    kept = trajectory[-1].kept
    return Sensitivity(
        kl_target=kl_target,
        met=trajectory[-1].kl_mean <= kl_target,
        harm=[GroupHarm(group=g, kl_mean_alone=harm[g]) for g in order],
        trajectory=trajectory,
        keep_bf16=[group_glob(g, groups[g]) for g in kept],
        precision_map={m: ("bf16" if fused_group(m) in kept else inputs.nvfp4.label) for m in quantized},
    )


def search(order: list[str], harm: dict[str, float], kl_of, bits_of, kl_target: float) -> list[SearchStep]:
    """The steps of the greedy search and its pruning (see the module docstring) over the groups
    `order` (most harmful first); `kl_of(kept)` measures a model, `bits_of(kept)` sizes it. The
    last step is the result."""

    def step(kept: list[str], kind: str) -> SearchStep:
        return SearchStep(kept=list(kept), kl_mean=kl_of(kept), step=kind, **bits_of(kept))

    kept: list[str] = []
    with progress.task("sensitivity search", total=None, unit="pass") as task:  # groups kept + pruned + 1
        trajectory = [step(kept, "start")]
        task.advance(description="nothing kept", fields={"kl": f"{trajectory[-1].kl_mean:.4g}"})
        for g in order:
            if trajectory[-1].kl_mean <= kl_target:
                break
            kept.append(g)
            progress.info(f"sensitivity: keeping {g} in BF16")
            trajectory.append(step(kept, "keep"))
            task.advance(description=f"{len(kept)} kept", fields={"kl": f"{trajectory[-1].kl_mean:.4g}"})
        if trajectory[-1].kl_mean > kl_target:
            return trajectory

        # prune: a group kept early may be unneeded once later ones are kept (harms do not add);
        # the least harmful alone are tried first, each dropped only if the target still holds
        def without(g: str) -> SearchStep:
            trial = step([k for k in kept if k != g], "prune")
            task.advance(description=f"without {g}", fields={"kl": f"{trial.kl_mean:.4g}"})
            return trial

        order = sorted(kept, key=lambda g: harm[g])
        for g, trial in prune_pass(order, without, lambda trial: trial.kl_mean <= kl_target):
            progress.info(f"sensitivity: {g} is not needed once the others are kept; quantized again")
            kept.remove(g)
            trajectory.append(trial)
    return trajectory


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
            "export: nvfp4tool export SOURCE --out OUT --keep-bf16-file keep_bf16.txt",
            f"train: bf16_patterns='{json.dumps(found.keep_bf16)}'",
        ],
    )


def export_with_file(source: str, keep_file: str) -> str:
    """The short export command that realises the result from its keep-BF16 file."""
    return f"nvfp4tool export {shlex.quote(source)} --out OUT --keep-bf16-file {shlex.quote(keep_file)}"


# ------------------------------------------------------------------------------------------
# helpers


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
    """What keeping groups in BF16 costs in bits: each quantized module's stored bytes in the
    export (weight, block and global scales, input scale) against its source weight's in BF16."""

    def __init__(self, exported, source, groups: dict[str, list[str]]) -> None:
        shapes = exported.config.expected_tensor_shapes()
        self._groups = groups
        self._stored = {m: exported.module_bytes(m) for ms in groups.values() for m in ms}
        self._bf16 = {m: 2 * int(np.prod(shapes[f"{m}.weight"])) for m in self._stored}
        self._weights = sum(int(np.prod(shapes[f"{m}.weight"])) for m in self._stored)
        self._parameters = sum(int(np.prod(shape)) for shape in shapes.values())
        self._model_bytes = exported.stored_bytes()

    def bits(self, kept: list[str]) -> dict[str, float]:
        extra = sum(self._bf16[m] - self._stored[m] for g in kept for m in self._groups[g])
        linears = sum(self._stored.values()) + extra
        return {
            "bits_per_weight": 8 * linears / self._weights,
            "bits_per_parameter": 8 * (self._model_bytes + extra) / self._parameters,
        }


def _layer_bf16(source, quantized: list[str], layer: int | None) -> dict[str, np.ndarray]:
    """{name as the block program sees it: BF16 source weight} of the quantized modules of `layer`
    (None: the LM head)."""
    return {name: source.get(f"{m}.weight") for name, m in layer_modules(quantized, layer).items()}
