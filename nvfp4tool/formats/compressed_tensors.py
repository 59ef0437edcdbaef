"""The compressed-tensors layouts (vLLM compressed-tensors, transformers + compressed-tensors):
NVFP4 W4A4 / W4A16 (`nvfp4-pack-quantized`), FP8 per tensor and FP8 128x128 blocks (both
`float-quantized`, told apart by the weights' `strategy`: "tensor" / "block", FP8_BLOCK_ARGS).

Global scales have shape [1]: NVFP4 ones are encode scales (S_enc = 1 / S_dec = 2688 / amax), FP8
and KV-cache ones decode scales (amax / 448); fp8-block's `weight_scale` is the fp32 decode-scale
grid [ceil(N/128), ceil(K/128)]; `ignore` / `targets` are exact names or `re:` regexes.
Design notes: docs/design/formats.md.
"""

from __future__ import annotations

from typing import Any

from nvfp4tool.formats.spec import CONFIG_FILE, KVScaleSpec, LayoutSpec, TensorSpec, fp8_block_grid
from nvfp4tool.numerics.constants import E4M3_MAX, FP8_BLOCK, NVFP4_BLOCK, NVFP4_GLOBAL_RANGE

FORMAT = "compressed-tensors"
CT_FORMAT = {
    "nvfp4": "nvfp4-pack-quantized",
    "nvfp4-weight-only": "nvfp4-pack-quantized",
    "fp8": "float-quantized",
    "fp8-block": "float-quantized",
}
MIXED_FORMAT = "mixed-precision"  # the top-level format of several groups' formats (CompressionFormat.mixed_precision)
# The quantization args of the weights (and, where present, the activations) per format; the
# keys in *_KEYS are the ones a reader must find with these values.
NVFP4_ARGS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": NVFP4_BLOCK,
    "symmetric": True,
    "dynamic": False,
    "observer": "static_minmax",
    "scale_dtype": "torch.float8_e4m3fn",
}
NVFP4_KEYS = ("num_bits", "type", "strategy", "group_size")
FP8_ARGS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "symmetric": True,
    "dynamic": False,
    "group_size": None,
    "observer": "minmax",
}
FP8_KEYS = ("num_bits", "type", "strategy")
# compressed-tensors' FP8_BLOCK preset scheme (quant_scheme.py; what llm-compressor writes and vLLM's
# CompressedTensorsW8A8Fp8 block path reads): weights 128x128 blocks, activations dynamic per
# token per 128-column group.
FP8_BLOCK_ARGS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": None,
    "strategy": "block",
    "block_structure": [FP8_BLOCK, FP8_BLOCK],
    "dynamic": False,
}
FP8_BLOCK_KEYS = ("num_bits", "type", "strategy", "block_structure")
FP8_BLOCK_INPUT_ARGS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": FP8_BLOCK,
    "strategy": "group",
    "dynamic": True,
}
FP8_BLOCK_INPUT_KEYS = ("num_bits", "type", "strategy", "group_size", "dynamic")
# --kv-cache -> kv_cache_scheme (what llm-compressor writes for a static per-tensor FP8 KV cache)
KV_CACHE_SCHEME = {"fp8": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}
KV_SCALES = KVScaleSpec(k_suffix="k_scale", v_suffix="v_scale", shape=(1,))


def _config(spec: LayoutSpec, excluded: tuple[str, ...], kv_cache: str | None) -> dict[str, Any]:
    return _quantization_config(CT_FORMAT[spec.quant], {"group_0": _group(spec, ("Linear",))}, excluded, kv_cache)


def mixed_config(
    schemes: tuple[tuple[LayoutSpec, tuple[str, ...]], ...], excluded: tuple[str, ...], kv_cache: str | None
) -> dict[str, Any]:
    """config.json["quantization_config"] of a mixed export: one config group per scheme, its
    `targets` the exact names of its linears, top-level `format: mixed-precision` (each group
    names its own, as compressed-tensors' `QuantizationConfig` and vLLM read it)."""
    groups = {f"group_{i}": _group(spec, targets) for i, (spec, targets) in enumerate(schemes)}
    return _quantization_config(MIXED_FORMAT, groups, excluded, kv_cache)


def _group(spec: LayoutSpec, targets: tuple[str, ...]) -> dict[str, Any]:
    if spec.is_fp8_block:
        weights, inputs = dict(FP8_BLOCK_ARGS), dict(FP8_BLOCK_INPUT_ARGS)
        weights["block_structure"] = list(FP8_BLOCK_ARGS["block_structure"])
    elif spec.is_nvfp4:
        weights, inputs = dict(NVFP4_ARGS), dict(NVFP4_ARGS, dynamic="local")
    else:
        weights, inputs = dict(FP8_ARGS), dict(FP8_ARGS)
    group: dict[str, Any] = {"targets": list(targets), "weights": weights}
    if spec.has_input_scales or spec.is_fp8_block:
        group["input_activations"] = inputs
    group["format"] = CT_FORMAT[spec.quant]
    return group


def _quantization_config(
    fmt: str, groups: dict[str, Any], excluded: tuple[str, ...], kv_cache: str | None
) -> dict[str, Any]:
    return {
        "quant_method": FORMAT,
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": list(excluded),
        "config_groups": groups,
        "kv_cache_scheme": dict(KV_CACHE_SCHEME[kv_cache]) if kv_cache else None,
    }


def _one(n: int, k: int) -> tuple[int, ...]:
    return (1,)


def _spec(quant: str) -> LayoutSpec:
    if quant == "fp8-block":
        tensors = [
            TensorSpec("weight", "weight", "F8_E4M3", lambda n, k: (n, k)),
            TensorSpec("block_scale", "weight_scale", "F32", fp8_block_grid),
        ]
    elif quant == "fp8":
        tensors = [
            TensorSpec("weight", "weight", "F8_E4M3", lambda n, k: (n, k)),
            TensorSpec("weight_global", "weight_scale", "F32", _one),
            TensorSpec("input_global", "input_scale", "F32", _one),
        ]
    else:
        tensors = [
            TensorSpec("weight", "weight_packed", "U8", lambda n, k: (n, k // 2)),
            TensorSpec("block_scale", "weight_scale", "F8_E4M3", lambda n, k: (n, k // NVFP4_BLOCK)),
            TensorSpec("weight_global", "weight_global_scale", "F32", _one),
        ]
        if quant == "nvfp4":
            tensors.append(TensorSpec("input_global", "input_global_scale", "F32", _one))
    return LayoutSpec(
        format=FORMAT,
        quant=quant,
        tensors=tuple(tensors),
        convention="encode" if quant in ("nvfp4", "nvfp4-weight-only") else "decode",
        pattern_style="exact-or-re",
        element_range=NVFP4_GLOBAL_RANGE if quant in ("nvfp4", "nvfp4-weight-only") else E4M3_MAX,
        packing=2 if quant in ("nvfp4", "nvfp4-weight-only") else 1,
        kv_scales=KV_SCALES,
        build_config=_config,
        build_hf_quant_config=None,
    )


SPECS = {quant: _spec(quant) for quant in CT_FORMAT}


def claims(qc: Any) -> bool:
    """Whether config.json's quantization_config claims a compressed-tensors layout."""
    return isinstance(qc, dict) and qc.get("quant_method") == FORMAT


def parse(qc: dict) -> tuple[str | None, Any, tuple[str, ...], list[tuple[str, str]], str]:
    """(quant or None when unsupported, ignore list as written, targets, [(file, problem)], the
    format(s) it names) of a compressed-tensors quantization_config."""
    problems: list[tuple[str, str]] = []
    groups = _groups(qc, problems)
    formats = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    named = ", ".join(sorted(map(str, formats))) or "none"
    if len(formats) != 1 or next(iter(formats)) not in CT_FORMAT.values():
        return None, None, (), problems, named
    fmt = next(iter(formats))
    _check_status(qc, problems)
    targets: list[str] = []
    quants = []
    for group_name, group in groups.items():
        group = group if isinstance(group, dict) else {}
        quants.append(_group_quant(group_name, group, fmt, problems))
        targets += _targets(group)
    # one format, several groups: NVFP4 W4A4 if any group quantizes activations (as before); FP8
    # groups of both strategies in one non-mixed config: the first group's (a problem names it)
    found = dict.fromkeys(quants)
    if fmt == CT_FORMAT["nvfp4"]:
        quant = "nvfp4" if "nvfp4" in found else "nvfp4-weight-only"
    else:
        quant = quants[0] if quants else "fp8"
        if len(found) > 1:
            problems.append(
                (CONFIG_FILE, f"config_groups mix {' and '.join(found)} under format {fmt}; use format mixed-precision")
            )
    return quant, qc.get("ignore"), tuple(targets), problems, fmt


def is_mixed(qc: Any) -> bool:
    """Whether a compressed-tensors quantization_config declares several formats (mixed-precision)."""
    return isinstance(qc, dict) and qc.get("format") == MIXED_FORMAT


def parse_mixed(qc: dict) -> tuple[list[tuple[str, tuple[str, ...]]], Any, list[tuple[str, str]]]:
    """([(quant, targets)] per config group in order, ignore list as written, [(file, problem)]) of
    a `format: mixed-precision` quantization_config; a group of an unsupported format is a problem."""
    problems: list[tuple[str, str]] = []
    groups = _groups(qc, problems)
    _check_status(qc, problems)
    schemes = []
    for group_name, group in groups.items():
        group = group if isinstance(group, dict) else {}
        fmt = group.get("format")
        if fmt not in CT_FORMAT.values():
            problems.append(
                (
                    CONFIG_FILE,
                    f"config_groups.{group_name}.format is {fmt!r}; a mixed-precision group needs one of "
                    f"{', '.join(sorted(set(CT_FORMAT.values())))}",
                )
            )
            continue
        schemes.append((_group_quant(group_name, group, fmt, problems), tuple(_targets(group))))
    return schemes, qc.get("ignore"), problems


def _groups(qc: dict, problems: list[tuple[str, str]]) -> dict:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        problems.append((CONFIG_FILE, "quantization_config.config_groups is not an object"))
        groups = {}
    if not groups:
        problems.append((CONFIG_FILE, "quantization_config has no config_groups"))
    return groups


def _check_status(qc: dict, problems: list[tuple[str, str]]) -> None:
    if qc.get("quantization_status") != "compressed":
        problems.append(
            (CONFIG_FILE, f"quantization_status is {qc.get('quantization_status')!r}, expected 'compressed'")
        )


def _group_quant(group_name: str, group: dict, fmt: str, problems: list[tuple[str, str]]) -> str:
    """The quant of one config group of format `fmt` (checking its weights' args, and an FP8
    block group's activations): NVFP4 by its input_activations, FP8 by its weights' strategy."""
    weights = group.get("weights") if isinstance(group.get("weights"), dict) else {}
    if fmt == CT_FORMAT["nvfp4"]:
        quant, args, keys = ("nvfp4" if group.get("input_activations") else "nvfp4-weight-only"), NVFP4_ARGS, NVFP4_KEYS
    elif weights.get("strategy") == FP8_BLOCK_ARGS["strategy"]:
        quant, args, keys = "fp8-block", FP8_BLOCK_ARGS, FP8_BLOCK_KEYS
    else:
        quant, args, keys = "fp8", FP8_ARGS, FP8_KEYS
    _check_args(f"config_groups.{group_name}.weights", weights, args, keys, fmt, problems)
    if quant == "fp8-block":
        inputs = group.get("input_activations") if isinstance(group.get("input_activations"), dict) else {}
        where = f"config_groups.{group_name}.input_activations"
        _check_args(where, inputs, FP8_BLOCK_INPUT_ARGS, FP8_BLOCK_INPUT_KEYS, fmt, problems)
    return quant


def _check_args(
    where: str, found: dict, args: dict, keys: tuple[str, ...], label: str, problems: list[tuple[str, str]]
) -> None:
    expected_args = {k: args[k] for k in keys}
    wrong = {k: found.get(k) for k, v in expected_args.items() if found.get(k) != v}
    if wrong:
        problems.append((CONFIG_FILE, f"{where} has {wrong}, {label} needs {expected_args}"))


def _targets(group: dict) -> list[str]:
    targets = group.get("targets") or []
    return [t for t in targets if isinstance(t, str)] if isinstance(targets, list) else []


def parse_kv_cache(qc: dict) -> tuple[str | None, list[tuple[str, str]]]:
    """(the quantized KV cache quantization_config.kv_cache_scheme announces, or None;
    [(file, problem)]): a scheme must have the FP8 static per-tensor values of KV_CACHE_SCHEME."""
    scheme = qc.get("kv_cache_scheme")
    if scheme is None:
        return None, []
    want = KV_CACHE_SCHEME["fp8"]
    wrong = {k: scheme.get(k) for k in want if scheme.get(k) != want[k]} if isinstance(scheme, dict) else scheme
    if wrong:
        return None, [
            (
                CONFIG_FILE,
                f"quantization_config.kv_cache_scheme has {wrong}; the FP8 KV cache "
                f"needs {want} (or null: no quantized KV cache)",
            )
        ]
    return "fp8", []
