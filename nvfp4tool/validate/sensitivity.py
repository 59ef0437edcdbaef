"""Which layers to keep in BF16 so that the NVFP4 export meets a KL target (greedy search).

    found = sensitivity(loaded, kl_target=0.02, batch_size=4)   # records.validation.Sensitivity
    found.keep_bf16        # fnmatch patterns for `nvfp4tool export --keep-bf16`
    found.precision_map    # {linear: "bf16" | "nvfp4"} for training (`bf16_patterns=` too)

The unit is a fused group (q/k/v, gate/up: one GEMM in serving engines, kept or quantized whole).
Each group's harm is the mean KL to BF16 when only that group is quantized; groups are then kept
in BF16 one at a time, most harmful first, re-measuring the whole model's KL after each, until the
KL target is met. The model is the export as served; a kept group runs its BF16 source weights
with unquantized inputs. One compiled program serves every combination (the keep flags are
traced), so the search costs one forward per step, not one compilation.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4tool import progress
from nvfp4tool.model import default_linear, forward
from nvfp4tool.recipes.precision import fused_group
from nvfp4tool.records.validation import GroupHarm, SearchStep, Sensitivity
from nvfp4tool.validate import metrics


def sensitivity(loaded, *, kl_target: float, batch_size: int) -> Sensitivity:
    """The greedy search (see the module docstring); `loaded` is runner.load_models' result."""
    quantized = list(loaded.nvfp4.exported.quantized)
    groups: dict[str, list[str]] = {}
    for m in quantized:
        groups.setdefault(fused_group(m), []).append(m)
    batches = [loaded.ids_SxL[i:i + batch_size] for i in range(0, len(loaded.ids_SxL), batch_size)]
    refs = [np.asarray(forward(loaded.bf16_model, ids)) for ids in batches]
    mixed = _mixed_logits_fn(loaded.nvfp4)
    graphdef, state = nnx.split(loaded.nvfp4.model)
    del graphdef
    weights = {m: loaded.bf16_weights[m] for m in quantized}

    def mean_kl(kept: set[str]) -> float:
        flags = {m: jnp.asarray(fused_group(m) in kept) for m in quantized}
        kl = [metrics.token_kl(ref, np.asarray(mixed(state, weights, flags, jnp.asarray(ids))))
              for ref, ids in zip(refs, batches)]
        return float(np.concatenate([k.ravel() for k in kl]).mean())

    names = list(groups)
    harm = {}
    with progress.task("sensitivity", total=len(names), unit="group") as task:
        for g in names:
            harm[g] = mean_kl(set(names) - {g})
            task.advance(description=g)
    order = sorted(names, key=lambda g: -harm[g])
    kept: list[str] = []
    trajectory = [SearchStep(kept=[], kl_mean=mean_kl(set()))]
    for g in order:
        if trajectory[-1].kl_mean <= kl_target:
            break
        kept.append(g)
        progress.info(f"sensitivity: keeping {g} in BF16")
        trajectory.append(SearchStep(kept=list(kept), kl_mean=mean_kl(set(kept))))
    return Sensitivity(kl_target=kl_target, met=trajectory[-1].kl_mean <= kl_target,
                       harm=[GroupHarm(group=g, kl_mean_alone=harm[g]) for g in order],
                       trajectory=trajectory, keep_bf16=[group_pattern(g, groups[g]) for g in kept],
                       precision_map={m: ("bf16" if fused_group(m) in kept else loaded.nvfp4.label)
                                      for m in quantized})


def group_pattern(group: str, members: list[str]) -> str:
    """An fnmatch pattern matching exactly the members of a fused group (or the module itself)."""
    if len(members) == 1:
        return members[0]
    prefix = group.rpartition(".")[0]
    suffixes = [m[len(prefix) + 1:] for m in members]
    if all(re.fullmatch(r"[qkv]_proj", s) for s in suffixes):
        return f"{prefix}.[qkv]_proj"
    if sorted(suffixes) == ["gate_proj", "up_proj"]:
        return f"{prefix}.[gu][ap]*_proj"  # gate_proj, up_proj; not down_proj
    return f"{prefix}.{{{','.join(suffixes)}}}"


def command_lines(found: Sensitivity, source: str) -> list[str]:
    """The export flags and the training override (precision map) that realise the result."""
    keep = " ".join(f"--keep-bf16 '{p}'" for p in found.keep_bf16)
    return [f"nvfp4tool export {source} --out OUT {keep}".rstrip(),
            f"nvfp4tool train ... bf16_patterns='{json.dumps(found.keep_bf16)}'"]


# ------------------------------------------------------------------------------------------
# helpers


def _mixed_logits_fn(candidate):
    """jit(state, bf16 weights, keep flags, ids) -> logits of the export with kept modules in BF16."""
    graphdef, _ = nnx.split(candidate.model)
    served_linear = candidate.linear

    def logits(state, weights, flags, ids_BxT):
        def linear(x, w_NxK, b_N, *, name):
            y_served = served_linear(x, w_NxK, b_N, name=name)
            if name not in flags:
                return y_served
            y_bf16 = default_linear(x, weights[name], b_N, name=name)
            return jnp.where(flags[name], y_bf16, y_served)

        return forward(nnx.merge(graphdef, state), ids_BxT, linear=linear)

    return jax.jit(logits)
