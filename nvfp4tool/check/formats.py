"""Which serving format a folder claims (sheet section 5), its tensor names, and its config rules.

    ModelOpt NVFP4 / W4A16_NVFP4   <m>.weight U8 [N,K/2], weight_scale F8_E4M3 [N,K/16],
                                   weight_scale_2 F32 [] (amax/2688), input_scale F32 [] (W4A4)
    ModelOpt FP8                   <m>.weight F8_E4M3 [N,K], weight_scale F32 [] (amax/448),
                                   input_scale F32 []
    compressed-tensors             <m>.weight_packed U8 [N,K/2], weight_scale F8_E4M3 [N,K/16],
      nvfp4-pack-quantized         weight_global_scale F32 [1] (2688/amax),
                                   input_global_scale F32 [1] (W4A4)

Exclusion lists are matched as their loaders match them: ModelOpt `exclude_modules` with fnmatch
wildcards (vLLM's `is_layer_excluded`), compressed-tensors `ignore`/`targets` as exact names or
`re:` regexes anchored at the start (`compressed_tensors.utils.match.match_name`), the target
"Linear" meaning any linear layer.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from typing import Any

from nvfp4tool.check.report import CONFIG_LEVEL, Problem
from nvfp4tool.errors import NVFP4ToolError

HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG = "config.json"
NVFP4_GROUP_SIZE = 16
# Keys vLLM reads from hf_quant_config.json["quantization"] (it refuses NVFP4 without group_size).
_MODELOPT_KEYS = {"nvfp4": ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"),
                  "fp8": ("quant_algo", "kv_cache_quant_algo", "exclude_modules")}
_MODELOPT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4-weight-only", "FP8": "fp8"}
_CT_FORMAT = "nvfp4-pack-quantized"


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """Tensor names and conventions of one serving format, plus its exclusion rules."""

    name: str  # "modelopt" or "compressed-tensors"
    quant: str  # "nvfp4", "nvfp4-weight-only" or "fp8"
    weight: str  # suffix of the (packed) weight
    block_scale: str | None  # suffix of the E4M3 block scales (None for FP8)
    weight_global: str  # suffix of the per-tensor weight scale
    input_global: str  # suffix of the per-tensor activation scale
    global_shape: tuple[int, ...]  # () ModelOpt, (1,) compressed-tensors
    exclude: tuple[str, ...]  # exclude_modules / ignore, as written
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors config_groups targets
    exclude_source: str = HF_QUANT_CONFIG  # the file the exclusion list came from (for messages)

    @property
    def is_nvfp4(self) -> bool:
        return self.quant != "fp8"

    @property
    def has_input_scales(self) -> bool:
        return self.quant != "nvfp4-weight-only"

    @property
    def quant_suffixes(self) -> tuple[str, ...]:
        """Suffixes only a quantized module carries (the weight itself is named alike in ModelOpt)."""
        extra = (self.weight,) if self.name == "compressed-tensors" else ()
        names = (self.block_scale, self.weight_global, self.input_global, "weight_scale",
                 "weight_scale_2", "input_scale") + extra
        return tuple(dict.fromkeys(s for s in names if s))

    def excluded_by(self, module: str) -> str | None:
        """The exclusion pattern that matches `module`, or None."""
        for pattern in self.exclude:
            if self.name == "compressed-tensors":
                if _ct_match(module, pattern):
                    return pattern
            elif fnmatch.fnmatchcase(module, pattern):
                return pattern
        return None

    def targeted(self, module: str, is_linear: bool) -> bool:
        """Whether the config's targets cover `module` (ModelOpt: every linear layer)."""
        if self.name != "compressed-tensors":
            return is_linear
        return any((is_linear and t == "Linear") or _ct_match(module, t) for t in self.targets)


def detect_format(folder: str) -> tuple[FormatSpec, list[Problem]]:
    """The folder's serving format and the problems of its JSON configs.

    Raises NVFP4ToolError when the folder declares no supported quantization at all.
    """
    problems: list[Problem] = []
    config = _read_json(folder, CONFIG, problems)
    hf_quant = _read_json(folder, HF_QUANT_CONFIG, problems) if os.path.exists(
        os.path.join(folder, HF_QUANT_CONFIG)) else None
    qc = (config or {}).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if hf_quant is not None or method == "modelopt":
        return _modelopt(folder, hf_quant, qc, problems), problems
    if method == "compressed-tensors":
        return _compressed_tensors(folder, qc, problems), problems
    raise NVFP4ToolError(f"{folder}: no {HF_QUANT_CONFIG} and config.json has no quantization_config "
                         f"with quant_method modelopt or compressed-tensors: not an NVFP4/FP8 "
                         f"serving checkpoint")


# ---------------------------------------------------------------------------------------- helpers


def _modelopt(folder: str, hf_quant: dict | None, qc: Any, problems: list[Problem]) -> FormatSpec:
    quantization = (hf_quant or {}).get("quantization")
    if hf_quant is None:
        problems.append(Problem(CONFIG_LEVEL, HF_QUANT_CONFIG, "missing (TensorRT-LLM and vLLM's "
                                                               "modelopt loader read it)"))
    elif not isinstance(quantization, dict):
        problems.append(Problem(CONFIG_LEVEL, HF_QUANT_CONFIG, "has no \"quantization\" object"))
        quantization = None
    algo = (quantization or {}).get("quant_algo") or (qc or {}).get("quant_algo")
    if algo not in _MODELOPT_ALGOS:
        raise NVFP4ToolError(f"{folder}: ModelOpt quant_algo {algo!r} is not supported; supported: "
                             f"{', '.join(_MODELOPT_ALGOS)}")
    quant = _MODELOPT_ALGOS[algo]
    if quantization is not None:
        required = _MODELOPT_KEYS["fp8" if quant == "fp8" else "nvfp4"]
        missing = [k for k in required if k not in quantization]
        if missing:
            problems.append(Problem(CONFIG_LEVEL, HF_QUANT_CONFIG,
                                    f"quantization lacks {', '.join(missing)} (vLLM requires "
                                    f"{', '.join(required)})"))
        if quant != "fp8" and "group_size" in quantization and quantization["group_size"] != NVFP4_GROUP_SIZE:
            problems.append(Problem(CONFIG_LEVEL, HF_QUANT_CONFIG, f"group_size is "
                                    f"{quantization['group_size']}, NVFP4 needs {NVFP4_GROUP_SIZE}"))
    exclude = (quantization or {}).get("exclude_modules")
    source = HF_QUANT_CONFIG
    if not isinstance(qc, dict):
        problems.append(Problem(CONFIG_LEVEL, CONFIG, "has no quantization_config (vLLM and "
                                                      "transformers detect the format from it)"))
    else:
        if qc.get("quant_method") != "modelopt":
            problems.append(Problem(CONFIG_LEVEL, CONFIG, f"quantization_config.quant_method is "
                                                          f"{qc.get('quant_method')!r}, expected 'modelopt'"))
        if qc.get("quant_algo") != algo:
            problems.append(Problem(CONFIG_LEVEL, CONFIG, f"quantization_config.quant_algo is "
                                                          f"{qc.get('quant_algo')!r} but {HF_QUANT_CONFIG} "
                                                          f"says {algo!r}"))
        ignore = qc.get("ignore", qc.get("exclude_modules"))
        if exclude is None:
            exclude, source = ignore, CONFIG
        elif ignore is not None and sorted(ignore) != sorted(exclude):
            problems.append(Problem(CONFIG_LEVEL, CONFIG,
                                    f"quantization_config.ignore {ignore} differs from "
                                    f"{HF_QUANT_CONFIG} exclude_modules {exclude}"))
    if quant == "fp8":
        return FormatSpec("modelopt", quant, weight="weight", block_scale=None,
                          weight_global="weight_scale", input_global="input_scale", global_shape=(),
                          exclude=_patterns(exclude, source, problems), exclude_source=source)
    return FormatSpec("modelopt", quant, weight="weight", block_scale="weight_scale",
                      weight_global="weight_scale_2", input_global="input_scale", global_shape=(),
                      exclude=_patterns(exclude, source, problems), exclude_source=source)


def _compressed_tensors(folder: str, qc: dict, problems: list[Problem]) -> FormatSpec:
    groups = qc.get("config_groups") or {}
    formats = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    if formats != {_CT_FORMAT}:
        raise NVFP4ToolError(f"{folder}: compressed-tensors format {sorted(formats) or None} is not "
                             f"supported; only {_CT_FORMAT}")
    if qc.get("quantization_status") != "compressed":
        problems.append(Problem(CONFIG_LEVEL, CONFIG, f"quantization_status is "
                                                      f"{qc.get('quantization_status')!r}, "
                                                      f"expected 'compressed'"))
    targets: list[str] = []
    has_input = False
    for group_name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        expected = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                    "group_size": NVFP4_GROUP_SIZE}
        wrong = {k: weights.get(k) for k, v in expected.items() if weights.get(k) != v}
        if wrong:
            problems.append(Problem(CONFIG_LEVEL, CONFIG, f"config_groups.{group_name}.weights has "
                                                          f"{wrong}, NVFP4 needs {expected}"))
        has_input = has_input or bool(group.get("input_activations"))
        targets += list(group.get("targets") or [])
    if not groups:
        problems.append(Problem(CONFIG_LEVEL, CONFIG, "quantization_config has no config_groups"))
    return FormatSpec("compressed-tensors", "nvfp4" if has_input else "nvfp4-weight-only",
                      weight="weight_packed", block_scale="weight_scale",
                      weight_global="weight_global_scale", input_global="input_global_scale",
                      global_shape=(1,), exclude=_patterns(qc.get("ignore"), CONFIG, problems),
                      targets=tuple(targets), exclude_source=CONFIG)


def _patterns(value: Any, source: str, problems: list[Problem]) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(Problem(CONFIG_LEVEL, source, f"exclusion list {value!r} is not a list of names"))
        return ()
    return tuple(value)


def _ct_match(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def _read_json(folder: str, name: str, problems: list[Problem]) -> dict | None:
    path = os.path.join(folder, name)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        problems.append(Problem(CONFIG_LEVEL, name, "missing"))
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as bad:
        problems.append(Problem(CONFIG_LEVEL, name, f"not valid JSON ({bad})"))
        return None
    if not isinstance(value, dict):
        problems.append(Problem(CONFIG_LEVEL, name, "is not a JSON object"))
        return None
    return value
