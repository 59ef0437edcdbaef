"""The ModelOpt "unified HF checkpoint" layouts (vLLM `modelopt_fp4` / `modelopt`, TensorRT-LLM,
SGLang): NVFP4 W4A4, W4A16, FP8 and FP8 128x128 blocks (`FP8_PB_WO`, uniform dense models only:
`fp8_block_problem`), their configs, and how a folder's configs are parsed.

Global scales are decode scales of shape [] (NVFP4 `weight_scale_2` = amax / 2688; FP8 and KV cache
amax / 448; FP8_PB_WO's grid [N/128, 1, K/128, 1]), declared in config.json and
hf_quant_config.json; exclusions are fnmatch patterns.
Design notes: docs/design/formats.md.
"""

from __future__ import annotations

from typing import Any

from nvfp4tool.families import expert_of
from nvfp4tool.formats.spec import (
    CONFIG_FILE,
    HF_QUANT_CONFIG_FILE,
    NVFP4_QUANTS,
    KVScaleSpec,
    LayoutSpec,
    TensorSpec,
    fp8_block_grid,
)
from nvfp4tool.numerics.constants import E4M3_MAX, FP8_BLOCK, NVFP4_BLOCK, NVFP4_GLOBAL_RANGE

FORMAT = "modelopt"
QUANT_ALGO = {"nvfp4": "NVFP4", "nvfp4-weight-only": "W4A16_NVFP4", "fp8": "FP8", "fp8-block": "FP8_PB_WO"}
QUANT_OF_ALGO = {algo: quant for quant, algo in QUANT_ALGO.items()}
MIXED_ALGO = "MIXED_PRECISION"  # per-linear algos in `quantized_layers` (vLLM's ModelOptMixedPrecisionConfig)
# Keys vLLM reads from hf_quant_config.json["quantization"] (it refuses NVFP4 without group_size).
# Quants a MIXED_PRECISION checkpoint cannot carry, and why: vLLM's ModelOptMixedPrecisionConfig
# (modelopt.py) maps only FP8 / NVFP4 / W4A16_NVFP4 per layer; a layer of any other algo in
# quantized_layers gets UnquantizedLinearMethod (its FP8 bytes loaded as BF16 weights).
MIXED_UNSUPPORTED = {
    "fp8-block": (
        "vLLM's ModelOpt MIXED_PRECISION loader maps no per-layer FP8_PB_WO (such a linear would load "
        "unquantized); use --format compressed-tensors for a mixed file with fp8-block linears"
    )
}
KV_CACHE_ALGO = {"fp8": "FP8"}  # --kv-cache -> kv_cache_quant_algo
KV_CACHE_SCHEME = {"fp8": {"dynamic": False, "num_bits": 8, "type": "float"}}  # config.json's form
KV_SCALES = KVScaleSpec(k_suffix="k_proj.k_scale", v_suffix="v_proj.v_scale", shape=())
REQUIRED_KEYS = {
    "nvfp4": ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"),
    "fp8": ("quant_algo", "kv_cache_quant_algo", "exclude_modules"),
}


def fp8_block_problem(module: str, n: int, k: int) -> str | None:
    """Why vLLM cannot load the linear `module` [N, K] as FP8_PB_WO, or None: its
    ModelOptFp8PbWoLinearMethod needs N and K multiples of 128 (it sizes the scale [N/128, 1, K/128, 1]
    and raises otherwise), and the MoE method of its FP8 config reads per-tensor expert scales."""
    if expert_of(module) is not None:
        return (
            "a routed expert: vLLM's ModelOpt FP8 MoE method reads per-tensor scales, not FP8_PB_WO blocks; "
            "keep the experts BF16 or use --format compressed-tensors"
        )
    if n % FP8_BLOCK or k % FP8_BLOCK:
        return (
            f"N x K = {n} x {k}: vLLM's ModelOpt FP8_PB_WO needs N and K multiples of {FP8_BLOCK}; "
            "keep it BF16 or use --format compressed-tensors (ragged N allowed there)"
        )
    return None


def _config(spec: LayoutSpec, excluded: tuple[str, ...], kv_cache: str | None) -> dict[str, Any]:
    config = _quantization_config(QUANT_ALGO[spec.quant], {"group_0": _group(spec, ("Linear",))}, excluded, kv_cache)
    if spec.is_nvfp4 or spec.is_fp8_block:
        config["group_size"] = NVFP4_BLOCK if spec.is_nvfp4 else FP8_BLOCK
    return config


def _group(spec: LayoutSpec, targets: tuple[str, ...]) -> dict[str, Any]:
    weights: dict[str, Any] = (
        {"num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK, "dynamic": False}
        if spec.is_nvfp4
        else {"num_bits": 8, "type": "float", "dynamic": False}
    )
    group: dict[str, Any] = {"targets": list(targets), "weights": weights}
    if spec.has_input_scales:
        group["input_activations"] = dict(weights)
    return group


def _quantization_config(
    algo: str, groups: dict[str, Any], excluded: tuple[str, ...], kv_cache: str | None
) -> dict[str, Any]:
    return {
        "quant_method": "modelopt",
        "quant_algo": algo,
        "kv_cache_quant_algo": KV_CACHE_ALGO.get(kv_cache),
        "kv_cache_scheme": KV_CACHE_SCHEME.get(kv_cache),
        "ignore": list(excluded),
        "exclude_modules": list(excluded),
        "config_groups": groups,
    }


def mixed_configs(
    schemes: tuple[tuple[LayoutSpec, tuple[str, ...]], ...],
    excluded: tuple[str, ...],
    producer: dict[str, str],
    kv_cache: str | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json["quantization_config"], hf_quant_config.json) of a mixed export, as ModelOpt's
    `process_layer_quant_config` / `convert_hf_quant_config_format` write them: `quant_algo:
    MIXED_PRECISION`, `quantized_layers` {module: {quant_algo, group_size (NVFP4)}}, one config
    group per algo whose targets are its module names; the BF16 linears in `exclude_modules`."""
    layers = {m: _layer_entry(spec) for spec, modules in schemes for m in modules}
    groups = {f"group_{i}": _group(spec, tuple(sorted(modules))) for i, (spec, modules) in enumerate(schemes)}
    config = _quantization_config(MIXED_ALGO, groups, excluded, kv_cache)
    config["quantized_layers"] = layers
    quantization = {
        "quant_algo": MIXED_ALGO,
        "kv_cache_quant_algo": KV_CACHE_ALGO.get(kv_cache),
        "exclude_modules": list(excluded),
        "quantized_layers": layers,
    }
    return config, {"producer": producer, "quantization": quantization}


def _layer_entry(spec: LayoutSpec) -> dict[str, Any]:
    entry: dict[str, Any] = {"quant_algo": QUANT_ALGO[spec.quant]}
    if spec.is_nvfp4:
        entry["group_size"] = NVFP4_BLOCK
    return entry


def _hf_quant_config(
    spec: LayoutSpec, excluded: tuple[str, ...], producer: dict[str, str], kv_cache: str | None
) -> dict[str, Any]:
    quantization: dict[str, Any] = {
        "quant_algo": QUANT_ALGO[spec.quant],
        "kv_cache_quant_algo": KV_CACHE_ALGO.get(kv_cache),
        "exclude_modules": list(excluded),
    }
    if spec.is_nvfp4 or spec.is_fp8_block:  # FP8_PB_WO: 128, as NVIDIA's checkpoints write it
        quantization["group_size"] = NVFP4_BLOCK if spec.is_nvfp4 else FP8_BLOCK
    return {"producer": producer, "quantization": quantization}


def _scalar(n: int, k: int) -> tuple[int, ...]:
    return ()


def _block_grid(n: int, k: int) -> tuple[int, ...]:
    rows, columns = fp8_block_grid(n, k)
    return (rows, 1, columns, 1)


def _spec(quant: str) -> LayoutSpec:
    if quant == "fp8-block":  # vLLM's ModelOptFp8PbWoLinearMethod: weight_scale [N/128, 1, K/128, 1]
        tensors = [
            TensorSpec("weight", "weight", "F8_E4M3", lambda n, k: (n, k)),
            TensorSpec("block_scale", "weight_scale", "F32", _block_grid),
        ]
    elif quant == "fp8":
        tensors = [
            TensorSpec("weight", "weight", "F8_E4M3", lambda n, k: (n, k)),
            TensorSpec("weight_global", "weight_scale", "F32", _scalar),
        ]
    else:
        tensors = [
            TensorSpec("weight", "weight", "U8", lambda n, k: (n, k // 2)),
            TensorSpec("block_scale", "weight_scale", "F8_E4M3", lambda n, k: (n, k // NVFP4_BLOCK)),
            TensorSpec("weight_global", "weight_scale_2", "F32", _scalar),
        ]
    if quant in ("nvfp4", "fp8"):
        tensors.append(TensorSpec("input_global", "input_scale", "F32", _scalar))
    return LayoutSpec(
        format=FORMAT,
        quant=quant,
        tensors=tuple(tensors),
        convention="decode",
        pattern_style="fnmatch",
        element_range=NVFP4_GLOBAL_RANGE if quant in NVFP4_QUANTS else E4M3_MAX,
        packing=2 if quant in NVFP4_QUANTS else 1,
        kv_scales=KV_SCALES,
        build_config=_config,
        build_hf_quant_config=_hf_quant_config,
    )


SPECS = {quant: _spec(quant) for quant in QUANT_ALGO}


def claims(qc: Any, hf_quant: Any) -> bool:
    """Whether a folder's configs claim a ModelOpt layout."""
    return hf_quant is not None or (isinstance(qc, dict) and qc.get("quant_method") == FORMAT)


def parse(qc: Any, hf_quant: dict | None) -> tuple[str | None, Any, str, list[tuple[str, str]]]:
    """(quant or None when unsupported, exclusion list as written, the file it came from,
    [(file, problem)]) of a folder whose configs claim ModelOpt."""
    problems: list[tuple[str, str]] = []
    quantization = (hf_quant or {}).get("quantization")
    if hf_quant is None:
        problems.append((HF_QUANT_CONFIG_FILE, "missing (TensorRT-LLM and vLLM's modelopt loader read it)"))
    elif not isinstance(quantization, dict):
        problems.append((HF_QUANT_CONFIG_FILE, 'has no "quantization" object'))
        quantization = None
    algo = (quantization or {}).get("quant_algo") or (qc.get("quant_algo") if isinstance(qc, dict) else None)
    quant = QUANT_OF_ALGO.get(algo) if isinstance(algo, str) else None
    if quant is None:
        return None, None, HF_QUANT_CONFIG_FILE, problems
    if quantization is not None:
        required = REQUIRED_KEYS["nvfp4" if quant in NVFP4_QUANTS else "fp8"]
        missing = [k for k in required if k not in quantization]
        if missing:
            problems.append(
                (HF_QUANT_CONFIG_FILE, f"quantization lacks {', '.join(missing)} (vLLM requires {', '.join(required)})")
            )
        if quant in NVFP4_QUANTS and "group_size" in quantization and quantization["group_size"] != NVFP4_BLOCK:
            problems.append(
                (HF_QUANT_CONFIG_FILE, f"group_size is {quantization['group_size']}, NVFP4 needs {NVFP4_BLOCK}")
            )
    exclude, source = (quantization or {}).get("exclude_modules"), HF_QUANT_CONFIG_FILE
    if not isinstance(qc, dict):
        problems.append((CONFIG_FILE, "has no quantization_config (vLLM and transformers detect the format from it)"))
    else:
        if qc.get("quant_method") != FORMAT:
            problems.append(
                (CONFIG_FILE, f"quantization_config.quant_method is {qc.get('quant_method')!r}, expected {FORMAT!r}")
            )
        if qc.get("quant_algo") != algo:
            problems.append(
                (
                    CONFIG_FILE,
                    f"quantization_config.quant_algo is {qc.get('quant_algo')!r} "
                    f"but {HF_QUANT_CONFIG_FILE} says {algo!r}",
                )
            )
        ignore = qc.get("ignore", qc.get("exclude_modules"))
        if exclude is None:
            exclude, source = ignore, CONFIG_FILE
        elif ignore is not None and _sorted(ignore) != _sorted(exclude):
            problems.append(
                (
                    CONFIG_FILE,
                    f"quantization_config.ignore {ignore} differs from "
                    f"{HF_QUANT_CONFIG_FILE} exclude_modules {exclude}",
                )
            )
    return quant, exclude, source, problems


def is_mixed(qc: Any, hf_quant: Any) -> bool:
    """Whether ModelOpt configs declare `quant_algo: MIXED_PRECISION`."""
    quantization = hf_quant.get("quantization") if isinstance(hf_quant, dict) else None
    algo = (quantization if isinstance(quantization, dict) else {}).get("quant_algo") or (
        qc.get("quant_algo") if isinstance(qc, dict) else None
    )
    return algo == MIXED_ALGO


def parse_mixed(qc: Any, hf_quant: dict | None) -> tuple[list[tuple[str, tuple[str, ...]]], Any, str, list]:
    """([(quant, module names)] in QUANTS order, exclusion list as written, the file it came from,
    [(file, problem)]) of MIXED_PRECISION configs: hf_quant_config.json's `quantized_layers` (what
    vLLM's ModelOptMixedPrecisionConfig looks each linear up in) must agree with config.json's."""
    problems: list[tuple[str, str]] = []
    quantization = (hf_quant or {}).get("quantization")
    if not isinstance(quantization, dict):
        problems.append((HF_QUANT_CONFIG_FILE, 'missing or has no "quantization" object (vLLM reads it)'))
        quantization = {}
    layers = quantization.get("quantized_layers")
    source = HF_QUANT_CONFIG_FILE
    if not isinstance(layers, dict) and isinstance(qc, dict):
        layers, source = qc.get("quantized_layers"), CONFIG_FILE
    if not isinstance(layers, dict) or not layers:
        problems.append((source, f"{MIXED_ALGO} without a quantized_layers object"))
        layers = {}
    if isinstance(qc, dict):
        if qc.get("quant_algo") != MIXED_ALGO:
            problems.append(
                (CONFIG_FILE, f"quantization_config.quant_algo is {qc.get('quant_algo')!r}, not {MIXED_ALGO!r}")
            )
        if "quantized_layers" in qc and qc["quantized_layers"] != layers:
            problems.append(
                (CONFIG_FILE, f"quantization_config.quantized_layers differs from {HF_QUANT_CONFIG_FILE}'s")
            )
    else:
        problems.append((CONFIG_FILE, "has no quantization_config (vLLM and transformers detect the format from it)"))
    by_quant: dict[str, list[str]] = {}
    for module, entry in layers.items():
        algo = entry.get("quant_algo") if isinstance(entry, dict) else None
        quant = QUANT_OF_ALGO.get(algo) if isinstance(algo, str) else None
        if quant is None:
            problems.append(
                (source, f"quantized_layers.{module}.quant_algo is {algo!r}; supported: {', '.join(QUANT_OF_ALGO)}")
            )
            continue
        if quant in MIXED_UNSUPPORTED:
            problems.append((source, f"quantized_layers.{module}.quant_algo is {algo!r}: {MIXED_UNSUPPORTED[quant]}"))
            continue
        if quant in NVFP4_QUANTS and entry.get("group_size") != NVFP4_BLOCK:
            problems.append(
                (
                    source,
                    f"quantized_layers.{module}.group_size is {entry.get('group_size')!r}, NVFP4 needs {NVFP4_BLOCK}",
                )
            )
        by_quant.setdefault(quant, []).append(module)
    schemes = [(q, tuple(by_quant[q])) for q in QUANT_ALGO if q in by_quant]
    exclude = quantization.get("exclude_modules")
    exclude_source = HF_QUANT_CONFIG_FILE
    if exclude is None and isinstance(qc, dict):
        exclude, exclude_source = qc.get("exclude_modules", qc.get("ignore")), CONFIG_FILE
    return schemes, exclude, exclude_source, problems


def _sorted(value: Any) -> Any:
    return sorted(value, key=str) if isinstance(value, list) else value


def parse_kv_cache(qc: Any, hf_quant: Any) -> tuple[str | None, list[tuple[str, str]]]:
    """(the quantized KV cache a ModelOpt folder announces, one of KV_CACHES, or None;
    [(file, problem)]): hf_quant_config.json's kv_cache_quant_algo (what vLLM's modelopt loader and
    TensorRT-LLM read) and config.json's kv_cache_scheme / kv_cache_quant_algo must agree."""
    problems: list[tuple[str, str]] = []
    quantization = (hf_quant or {}).get("quantization") if isinstance(hf_quant, dict) else None
    algo = quantization.get("kv_cache_quant_algo") if isinstance(quantization, dict) else None
    of_algo = {a: kv for kv, a in KV_CACHE_ALGO.items()}
    kv = of_algo.get(algo) if isinstance(algo, str) else None
    if algo is not None and kv is None:
        problems.append(
            (
                HF_QUANT_CONFIG_FILE,
                f"kv_cache_quant_algo {algo!r} is not supported; "
                f"supported: {', '.join(KV_CACHE_ALGO.values())} or null",
            )
        )
    if isinstance(qc, dict):
        scheme, qc_algo = qc.get("kv_cache_scheme"), qc.get("kv_cache_quant_algo")
        by_scheme = next((k for k, v in KV_CACHE_SCHEME.items() if scheme == v), None)
        if scheme is not None and by_scheme is None:
            problems.append(
                (
                    CONFIG_FILE,
                    f"quantization_config.kv_cache_scheme {scheme!r} is not {KV_CACHE_SCHEME['fp8']} (FP8) or null",
                )
            )
        elif by_scheme != kv or (qc_algo is not None and qc_algo != algo):
            problems.append(
                (
                    CONFIG_FILE,
                    f"quantization_config.kv_cache_scheme {scheme!r} / "
                    f"kv_cache_quant_algo {qc_algo!r} disagree with "
                    f"{HF_QUANT_CONFIG_FILE} kv_cache_quant_algo {algo!r}",
                )
            )
    return kv, problems
