"""The folder's tensors against the model its config.json describes, read as the loaders read it.

`read_model_config` (config.json through `ModelConfig.from_hf_config`: a config that does not parse
is a problem naming the key), `check_against_model` (every tensor the model needs with its shape,
none it lacks beyond the layout's extras), `check_dtypes` (unquantized dtypes against config.json's).
Design notes: docs/design/check.md.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Collection, Mapping

from nvfp4tool.check.files import TensorEntry
from nvfp4tool.check.formats import CONFIG
from nvfp4tool.check.report import CONFIG_LEVEL, ModuleStats, Problem
from nvfp4tool.config import ModelConfig, read_hf_config
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import LM_HEAD, expert_of, layer_index
from nvfp4tool.formats import FolderLayout, LayoutSpec


def read_model_config(folder: str, config_reported: bool) -> tuple[ModelConfig | None, list[Problem]]:
    """(the model config.json describes, or None; its problem). A config.json that is not readable
    JSON at all is reported by the format detection (`config_reported`), not twice."""
    try:
        _, hf = read_hf_config(os.path.join(folder, CONFIG))
    except NVFP4ToolError as unreadable:
        return None, [] if config_reported else [Problem(CONFIG_LEVEL, CONFIG, str(unreadable))]
    try:
        config = ModelConfig.from_hf_config(hf, source=CONFIG)
    except NVFP4ToolError as bad:
        why = str(bad).removeprefix(f"{CONFIG}: ")
        return None, [
            Problem(
                CONFIG_LEVEL,
                CONFIG,
                f"{why} (transformers and vLLM build the model from {CONFIG}: not loadable as a supported family)",
            )
        ]
    return config, []


def stored_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of `config`'s model under the name its checkpoints store it by
    (`Family.checkpoint_name`: nemotron_h's `backbone.*`), the names a folder is checked by."""
    return {config.family_spec.checkpoint_name(n): s for n, s in config.expected_tensor_shapes().items()}


def attention_modules(config: ModelConfig) -> list[str]:
    """The attention module of every decoder layer of `config`'s model (where KV-cache scales go),
    as its checkpoints name it."""
    return [config.family_spec.checkpoint_name(a) for a in config.modules.attentions]


def check_against_model(
    config: ModelConfig,
    entries: Mapping[str, TensorEntry],
    quantized: Mapping[str, ModuleStats],
    layout: FolderLayout,
    reported: Collection[str] = (),
) -> list[Problem]:
    """Problems of the folder's tensors against `config`'s model (see the module docstring).
    Modules and tensors in `reported` (named by earlier problems) are skipped: one root cause, one
    report. A config.json key the tensors contradict (`Family.tensors_contradiction`) is the one
    problem then, not the tensors it makes missing or unexpected."""
    spec_family = config.family_spec
    contradiction = spec_family.tensors_contradiction(config, [spec_family.our_name(n) for n in entries])
    if contradiction is not None:
        return [Problem(CONFIG_LEVEL, CONFIG, contradiction.removeprefix(f"{CONFIG}'s "))]
    problems = [
        Problem(
            router,
            ", ".join(sorted(n for n in entries if n.rpartition(".")[0] == router)),
            "MoE router is quantized: routers must stay BF16 (keep it out of the quantized "
            "modules and list it in the exclusion list)",
        )
        for router in map(config.family_spec.checkpoint_name, config.router_names())
        if router in quantized
    ]
    expected = stored_shapes(config)
    for name, shape in expected.items():
        module = name.rpartition(".")[0]
        if module in reported or name in reported:
            continue
        if module in quantized and name.endswith(".weight") and len(shape) == 2:
            stats = quantized[module]
            if stats.n is not None and (stats.n, stats.k) != shape:
                problems.append(
                    Problem(
                        module,
                        name,
                        f"quantized weight holds N x K = {stats.n} x "
                        f"{stats.k}, but {CONFIG}'s model needs "
                        f"{shape[0]} x {shape[1]}",
                    )
                )
        elif name not in entries:
            problems.append(Problem(module, name, f"missing: {CONFIG}'s model needs {list(shape)}"))
        elif entries[name].shape != shape:
            problems.append(
                Problem(module, name, f"has shape {list(entries[name].shape)}, {CONFIG}'s model needs {list(shape)}")
            )
    return problems + _extra_tensors(config, entries, expected, layout, reported)


def _extra_tensors(
    config: ModelConfig,
    entries: Mapping[str, TensorEntry],
    expected: Mapping[str, tuple[int, ...]],
    layout: FolderLayout,
    reported: Collection[str],
) -> list[Problem]:
    """One problem per module holding tensors that are neither the model's nor a documented extra
    (the quantization tensors of any of the folder's schemes)."""
    spec = layout.spec
    allowed = set(expected)
    allowed |= {
        f"{name.removesuffix('.weight')}.{suffix}"
        for name, shape in expected.items()
        if name.endswith(".weight") and len(shape) == 2
        for scheme in layout.specs
        for suffix in scheme.suffixes
    }
    allowed |= {n for attention in attention_modules(config) for n in spec.kv_scales.names(attention)}
    extra: dict[str, list[str]] = {}
    for name in entries:
        module = name.rpartition(".")[0]
        if name not in allowed and name not in reported and module not in reported:
            extra.setdefault(module, []).append(name)
    return [
        Problem(module, ", ".join(sorted(names)), _why_not_in_model(names[0], config, spec))
        for module, names in sorted(extra.items())
    ]


def _why_not_in_model(name: str, config: ModelConfig, spec: LayoutSpec) -> str:
    refused = "engines refuse (vLLM) or silently drop (transformers) a tensor the model lacks"
    layer = layer_index(name)
    if layer is not None and layer >= config.num_layers:
        return (
            f"layer {layer}, but {CONFIG}'s model has {config.num_layers} layers "
            f"(num_hidden_layers = {config.num_layers}, layers 0..{config.num_layers - 1}): {refused}"
        )
    expert = expert_of(name)
    if expert is not None and layer is not None:
        i, e = layer, expert[1]
        count = len({m.expert for m in config.modules.linears if m.layer == i and m.expert is not None})
        if count == 0:
            return (
                f"an expert of layer {i}, which is dense in {CONFIG}'s model (decoder_sparse_step / "
                f"mlp_only_layers, or not a mixture-of-experts family): {refused}"
            )
        if e >= count:
            record = config.family_spec.experts(config)  # `moe.Experts` names the key the count came from
            key = f"{record.hf_experts_key or 'num_experts'} = {count}, " if record is not None else ""
            return (
                f"expert {e}, but {CONFIG}'s model has {count} experts per sparse layer "
                f"({key}experts 0..{count - 1}): {refused}"
            )
    if name == f"{LM_HEAD}.weight" and config.tie_word_embeddings:
        return (
            f"{CONFIG} ties lm_head to the embedding (tie_word_embeddings = true), so the model has no "
            f"lm_head.weight: {refused}"
        )
    return (
        f"not a tensor of {CONFIG}'s {config.family} model, nor a {spec.label} quantization tensor of "
        f"one of its linear layers or a KV-cache scale of one of its attention layers: {refused}"
    )


def check_dtypes(
    folder: str,
    entries: Mapping[str, TensorEntry],
    quantized: Mapping[str, LayoutSpec],
    stored_fp32: tuple[str, ...] = (),
) -> list[Problem]:
    """Unquantized floating tensors against config.json's `dtype` / `torch_dtype`: a BF16 tensor
    whose header was relabelled F16 (same size, every value wrong) loads without complaint
    otherwise; an unquantized weight / bias with an integer dtype (F32 relabelled I32) neither.
    Tensors of quantized modules (their dtypes are the layout's) and single-element scales are not
    judged here."""
    try:
        with open(os.path.join(folder, CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return []  # reported by the format detection
    declared = config.get("dtype", config.get("torch_dtype")) if isinstance(config, dict) else None
    want = _CODE_OF_TORCH_DTYPE.get(declared) if isinstance(declared, str) else None
    if want is None:
        return []
    problems = []
    for name, entry in entries.items():
        module, _, suffix = name.rpartition(".")
        if module in quantized and suffix in quantized[module].suffixes:
            continue
        if entry.code in _INTEGER and suffix in ("weight", "bias"):  # e.g. F32 relabelled I32
            problems.append(
                Problem(
                    module,
                    name,
                    f"is {entry.code}, not a floating dtype, for an "
                    f"unquantized parameter ({CONFIG} says dtype {declared})",
                )
            )
        elif entry.code == "F32" and any(fnmatch.fnmatchcase(name, p) for p in stored_fp32):
            continue  # the family stores it in FP32 (`Family.stored_fp32`, `kept_as_stored`: Nemotron-H's)
        elif entry.code in _FLOAT16_32 and math.prod(entry.shape) > 1 and entry.code != want:
            problems.append(
                Problem(
                    module, name, f"is {entry.code} but {CONFIG} says dtype {declared} ({want}): relabelled header?"
                )
            )
    return problems


_CODE_OF_TORCH_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_FLOAT16_32 = ("BF16", "F16", "F32")
# Integer dtypes no parameter of ours has (U8 / F8 are quantized data, judged by the module checks).
_INTEGER = ("I8", "I16", "I32", "I64", "U16", "U32", "U64", "BOOL")
