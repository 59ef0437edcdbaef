"""push takes the card's base_model and license from what the export knows (issue 42: it asked for
`--base-model` and `--license` for a source whose provenance it holds): a tiny export of a local
source folder whose config.json names its Hub repo (`_name_or_path`) and whose README.md's metadata
names its license; push's card says both without being told, and still asks when neither is known."""

from __future__ import annotations

import json
import os

import numpy as np
import yaml

from converters.hf import SINGLE_FILE, write_safetensors
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.hub import PushOptions, push_checkpoint

from fixtures.validate_fixtures import CONFIG

HUB_ID = "HuggingFaceTB/SmolLM2-135M"


def _source(folder, *, name_or_path: str | None, license: str | None) -> str:
    os.makedirs(folder)
    shapes = CONFIG.expected_tensor_shapes()
    rng = np.random.default_rng(0)
    write_safetensors(
        os.path.join(folder, SINGLE_FILE),
        [(n, CONFIG.dtype, s) for n, s in shapes.items()],
        lambda n: (0.02 * rng.standard_normal(shapes[n], dtype=np.float32) + n.endswith("norm.weight")).astype(
            CONFIG.dtype
        ),
    )
    config = CONFIG.to_hf_config() | ({"_name_or_path": name_or_path} if name_or_path else {})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    if license:
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(f"---\nlibrary_name: transformers\nlicense: {license}\n---\n# a model\n")
    return str(folder)


def _card(source: str, out: str) -> tuple[dict, list[str]]:
    export_checkpoint(source, out, ExportOptions(quant="nvfp4-weight-only", show_progress=False))
    warnings: list[str] = []
    result = push_checkpoint(
        out,
        PushOptions(repo_id="me/smol-nvfp4", dry_run=True, require_validation=False),
        echo=lambda _: None,
        warn=warnings.append,
    )
    return yaml.safe_load(result.card.split("---\n")[1]), warnings


def test_push_takes_base_model_from_the_source_config_and_license_from_its_card(tmp_path):
    source = _source(tmp_path / "smollm2-local", name_or_path=HUB_ID, license="apache-2.0")
    meta, warnings = _card(source, str(tmp_path / "export"))
    assert meta["base_model"] == HUB_ID and meta["license"] == "apache-2.0", meta
    assert not [w for w in warnings if "base_model" in w or "license" in w], warnings


def test_push_still_asks_when_the_source_names_neither(tmp_path):
    local_path = str(tmp_path / "elsewhere" / "model")  # a local path in _name_or_path is no Hub id
    os.makedirs(local_path)
    source = _source(tmp_path / "local", name_or_path=local_path, license=None)
    meta, warnings = _card(source, str(tmp_path / "export"))
    assert "base_model" not in meta and "license" not in meta, meta
    assert any("--base-model" in w for w in warnings) and any("--license" in w for w in warnings), warnings
