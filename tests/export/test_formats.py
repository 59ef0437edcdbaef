"""The serving layouts declared in `nvfp4tool.formats`, end to end: every (format x quant) that
export writes passes `check` (CLI, in-process) and `push --dry-run`, converts to the other format
and back losslessly (byte-identical tensors) and the converted folders pass `check` too; and the
specs' own rules
(role round trip, scale conventions, exclusion matching, folder detection)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource
from nvfp4tool import formats
from nvfp4tool.cli import cli
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export import export_checkpoint
from nvfp4tool.export.convert_format import convert_format
from nvfp4tool.records.export import ExportRecord

from fixtures.export_fixtures import export_options, synthetic_config, synthetic_source

CONFIG = synthetic_config(hidden=64, mlp=128, layers=1, vocab=128, head_dim=16, kv_heads=2, dtype="bfloat16")
COMBOS = sorted(formats.SPECS)  # (format, quant) x 8
OTHER = {"modelopt": "compressed-tensors", "compressed-tensors": "modelopt"}
# exported from CONFIG (K = 64): fp8-block needs K % 128 == 0, tests/export/test_fp8_block.py exports it
BOTH = [(f, q) for f, q in COMBOS if q != "fp8-block"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{(format, quant): export folder} of one tiny model, plus "src"."""
    root = tmp_path_factory.mktemp("formats")
    src, calib = synthetic_source(root, CONFIG, seed=7)
    out = {"src": src}
    for fmt, quant in BOTH:
        folder = str(root / f"{fmt}-{quant}")
        export_checkpoint(src, folder, export_options(calib, format=fmt, quant=quant))
        out[(fmt, quant)] = folder
    return out


def _check_cli(folder: str):
    return CliRunner().invoke(cli, ["check", folder, "--tp", "1,2"])


def _tensor_bytes(folder: str) -> dict[str, bytes]:
    source = HFFolderSource(folder, check_config=False)
    return {n: np.ascontiguousarray(source.get(n)).reshape(-1).view(np.uint8).tobytes() for n in source.names()}


@pytest.mark.parametrize("fmt,quant", BOTH)
def test_every_export_passes_check_and_converts_losslessly_both_ways(built, tmp_path, fmt, quant):
    folder = built[(fmt, quant)]
    result = _check_cli(folder)
    assert result.exit_code == 0, result.output
    assert f"{fmt} {quant}" in result.output and ": OK" in result.output
    layout = formats.describe(folder)
    assert (layout.format, layout.quant, layout.spec) == (fmt, quant, formats.get(fmt, quant))

    there, back = str(tmp_path / "there"), str(tmp_path / "back")
    convert_format(folder, there, to=OTHER[fmt])
    convert_format(there, back, to=fmt)
    for converted in (there, back):
        result = _check_cli(converted)  # the carried-over record (new names, hashes) checks too
        assert result.exit_code == 0, (converted, result.output)
    assert _tensor_bytes(back) == _tensor_bytes(folder)  # byte-identical tensors after the round trip
    # the converted layout holds exactly what a direct export into it holds
    assert _tensor_bytes(there) == _tensor_bytes(built[(OTHER[fmt], quant)])
    assert ExportRecord.read(there).format == OTHER[fmt]
    # and push accepts it (dry run: the check, then the model card; nothing uploaded)
    result = CliRunner().invoke(cli, ["push", folder, "--repo-id", "org/tiny", "--dry-run", "--no-validation"])
    assert result.exit_code == 0, result.output


def test_export_folder_has_normal_permissions(built):
    umask = os.umask(0)
    os.umask(umask)
    for key, folder in built.items():
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~umask, key


# ----------------------------------------------------------------------------- the specs themselves


@pytest.mark.parametrize("fmt,quant", COMBOS)
def test_layout_roles_round_trip_and_conventions(fmt, quant):
    spec = formats.get(fmt, quant)
    n, k = 32, 64
    layout = spec.layout("m", n, k)
    assert [name for name, _, _ in layout] == [f"m.{s}" for s in spec.suffixes]
    rng = np.random.default_rng(0)
    roles = {}
    for name, dtype, shape in layout:
        role = next(t.role for t in spec.tensors if f"m.{t.suffix}" == name)
        if role == "block_scale" and spec.is_fp8_block:  # the role is the grid; ModelOpt stores [N/128, 1, K/128, 1]
            shape = (-(-n // 128), -(-k // 128))
        roles[role] = (
            np.asarray(rng.uniform(1e-4, 1e-2), np.float32).reshape(())
            if role in formats.GLOBAL_ROLES
            else rng.integers(0, 100, shape).astype(dtype)
        )
    stored = spec.from_roles("m", roles)
    assert [(n_, a.dtype.name, a.shape) for n_, a in stored.items()] == layout
    for role in formats.GLOBAL_ROLES:
        if role in roles:
            value = stored[f"m.{spec.suffix(role)}"].reshape(())
            expected = roles[role] if spec.convention == "decode" else np.float32(1) / roles[role]
            assert value == expected
    back = spec.to_roles("m", stored)
    assert set(back) == set(roles) and all(np.array_equal(back[r], roles[r]) for r in roles)
    with pytest.raises(NVFP4ToolError, match=r"m\.bogus"):
        spec.to_roles("m", {**stored, "m.bogus": np.zeros(1)})


def test_exclusion_matching_per_family():
    mo, ct = formats.get("modelopt", "nvfp4"), formats.get("compressed-tensors", "nvfp4")
    module = "model.layers.1.mlp.down_proj"
    assert mo.excluded_by(module, ("model.layers.1.*",)) == "model.layers.1.*"
    assert ct.excluded_by(module, ("model.layers.1.*",)) is None  # exact names or re: only
    assert ct.excluded_by(module, ("re:.*down_proj$",)) == "re:.*down_proj$"
    assert ct.excluded_by(module, ("re:mlp",)) is None  # anchored at the start
    assert ct.excluded_by(module, (module,)) == module
    assert ct.pattern_problem("re:model.(") is not None and mo.pattern_problem("re:model.(") is None
    assert ct.excluded_by(module, ("re:model.(",)) is None  # a malformed regex never matches


def test_modelopt_algo_names_and_inverse_are_one_table():
    from nvfp4tool.formats import modelopt

    assert set(modelopt.QUANT_ALGO) == set(formats.QUANTS)
    assert {modelopt.QUANT_OF_ALGO[a] for a in modelopt.QUANT_ALGO.values()} == set(formats.QUANTS)


def test_describe_refuses_folders_without_a_layout(built, tmp_path):
    with pytest.raises(NVFP4ToolError, match="not an NVFP4/FP8 serving checkpoint"):
        formats.describe(built["src"])
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(NVFP4ToolError, match="not valid JSON"):  # not "no quantization_config"
        formats.describe(str(tmp_path))


def _rewrite(folder: str, edit) -> None:
    """Rewrite `folder`'s single safetensors file with `edit(tensors)` applied."""
    from converters.hf import write_safetensors

    source = HFFolderSource(folder, check_config=False)
    tensors = {n: source.get(n) for n in source.names()}
    edit(tensors)
    path = os.path.join(folder, "model.safetensors")
    os.remove(path)
    write_safetensors(path, [(n, a.dtype.name, a.shape) for n, a in tensors.items()], tensors.__getitem__)


DOWN = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize("defect", ["zero-global-scale", "missing-global-scale"])
def test_convert_format_refuses_what_check_refuses(built, tmp_path, defect):
    import shutil

    src = str(tmp_path / "src")
    shutil.copytree(built[("modelopt", "nvfp4")], src)
    name = f"{DOWN}.weight_scale_2"
    if defect == "zero-global-scale":  # would become inf in compressed-tensors
        _rewrite(src, lambda t: t.__setitem__(name, np.zeros((), np.float32)))
    else:  # would produce a mixed-format folder
        _rewrite(src, lambda t: t.pop(name))
    result = CliRunner().invoke(cli, ["convert-format", src, str(tmp_path / "out"), "--to", "compressed-tensors"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and name in errors[0] and "check failed" in errors[0] and "not converted" in errors[0], (
        result.output
    )
    assert sorted(os.listdir(tmp_path)) == ["src"]  # nothing written, not even a temporary folder
