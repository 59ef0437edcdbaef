"""The one checkpoint opener, through every command that opens a checkpoint (convert SRC,
export SRC, validate --source, train model=): the same mistake gives the same one-line message
(options spelled as that command takes them) and the same exit code, and creates nothing."""

from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import write_hf_folder
from converters.tensor_source import DictTensorSource
from nvfp4tool.checkpoints import open_checkpoint, run_steps
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.convert import convert_checkpoint
from nvfp4tool.errors import NVFP4UsageError
from nvfp4tool.export import ExportOptions, export_checkpoint

CONFIG = ModelConfig(
    family="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    dtype="float32",
)
CLI_SPELLING = {"src": "{}", "model_config": "--model-config {}", "rope_layout": "--rope-layout {}"}
TRAIN_SPELLING = {"src": "model={}", "model_config": "model_config={}", "rope_layout": "rope_layout={}"}
VALIDATE_SPELLING = {**CLI_SPELLING, "src": "--source {}"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("opener")
    rng = np.random.default_rng(0)
    tensors = {
        n: (0.02 * rng.standard_normal(s)).astype(np.float32) for n, s in CONFIG.expected_tensor_shapes().items()
    }
    paths = {
        "root": root,
        "hf": str(root / "hf"),
        "mt": str(root / "mt"),
        "export": str(root / "export"),
        "empty": str(root / "empty"),
        "missing": str(root / "missing"),
        "data": str(root / "data.txt"),
    }
    write_hf_folder(paths["hf"], CONFIG, DictTensorSource(tensors), dtype="fp32")
    convert_checkpoint(paths["hf"], paths["mt"], to="maxtext", rope_layout="half")
    export_checkpoint(paths["hf"], paths["export"], ExportOptions(quant="nvfp4-weight-only", show_progress=False))
    os.makedirs(paths["empty"])
    (root / "data.txt").write_text("to be or not to be " * 50)
    return paths


def _command(command: str, path: str, options: dict[str, str], inputs, out: str) -> list[str]:
    """The command line that opens `path` with `options` ({"model_config": ..., "rope_layout": ...})."""
    if command == "train":
        return [
            "train",
            f"model={path}",
            f"data={inputs['data']}",
            f"out={out}",
            "tokenizer=train",
            "steps=1",
            *(f"{k}={v}" for k, v in options.items()),
        ]
    flags = [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", v)]
    if command == "convert":
        return ["convert", path, out, "--to", "hf", *flags]
    if command == "export":
        return ["export", path, "--out", out, "--quant", "nvfp4-weight-only", *flags]
    assert command == "validate" and not options
    return [
        "validate",
        inputs["export"],
        "--data",
        inputs["data"],
        "--reference",
        "bf16",
        "--source",
        path,
        "--json",
        out,
    ]


# (case, path key, options, exit code, message template: {path} and the spelled options)
CASES = [
    ("missing path", "missing", {}, 2, "{src:{path}}: not found"),
    (
        "no checkpoint at all",
        "empty",
        {},
        1,
        "{path}: neither an HF folder (config.json + *.safetensors), a MaxText Orbax checkpoint "
        "(<base>/<step>/items) nor an nvfp4tool training run (run.json + hf/)",
    ),
    (
        "MaxText without a model config",
        "mt",
        {},
        2,
        "{path}: a MaxText checkpoint carries no model config; pass {model_config:CONFIG} (an HF "
        "config.json / folder, or a MaxText model name such as llama3.1-8b)",
    ),
    (
        "unknown model name",
        "mt",
        {"model_config": "llama9"},
        2,
        "{model_config:llama9}: neither a file/folder nor a known MaxText model name (llama2-7b, "
        "llama2-13b, llama3-8b, llama3.1-8b, llama3.1-70b, llama3.2-1b, llama3.2-3b, mistral-7b, "
        "qwen3-30b-a3b, qwen3-235b-a22b, qwen3-480b-a35b, mixtral-8x7b, mixtral-8x22b, gemma3-4b, gemma3-12b, "
        "gemma3-27b, deepseek3-671b)",
    ),
    (
        "RoPE layout cannot be told",
        "mt",
        {"model_config": "HF_CONFIG"},
        2,
        "{path}: which RoPE layout does the MaxText side use? pass {rope_layout:interleaved|half}, or a "
        "MaxText model name as {model_config:NAME} (llama3.1-8b, llama3.1-70b, deepseek3-671b are interleaved, "
        "the others half)",
    ),
    (
        "config disagrees with the HF folder",
        "hf",
        {"model_config": "llama3.1-8b"},
        1,
        "{path}: its config.json describes a different model than {model_config:llama3.1-8b}",
    ),
]


def _expected(template: str, path: str, spelling: dict[str, str]) -> str:
    text = template.replace("{path}", path)
    for key, spelled in spelling.items():
        while "{" + key + ":" in text:
            start = text.index("{" + key + ":")
            end = text.index("}", start)
            text = text[:start] + spelled.format(text[start + len(key) + 2 : end]) + text[end + 1 :]
    return text


@pytest.mark.parametrize("case, key, options, code, template", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_same_mistake_same_message_and_exit_code_in_every_command(inputs, tmp_path, case, key, options, code, template):
    path = inputs[key]
    options = {k: (os.path.join(inputs["hf"], "config.json") if v == "HF_CONFIG" else v) for k, v in options.items()}
    # validate takes no model options: its MaxText message differs (test below)
    commands = ["convert", "export", "train"] + (["validate"] if key in ("missing", "empty") else [])
    lines = {}
    for command in commands:
        out = str(tmp_path / f"out-{command}")
        before = sorted(os.listdir(inputs["root"]))
        result = CliRunner().invoke(cli, _command(command, path, options, inputs, out))
        assert result.exit_code == code, (command, result.output)
        errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and "Traceback" not in result.output, (command, result.output)
        lines[command] = errors[0]
        assert not os.path.exists(out), command  # nothing created
        assert sorted(os.listdir(inputs["root"])) == before
    spelled = {
        k: _expected(
            template.replace("HF_CONFIG", options.get("model_config", "")),
            path,
            {"train": TRAIN_SPELLING, "validate": VALIDATE_SPELLING}.get(k, CLI_SPELLING),
        )
        for k in commands
    }
    for command in commands:
        assert lines[command] == "Error: " + spelled[command], command


def test_validate_cannot_take_a_maxtext_source(inputs, tmp_path):
    result = CliRunner().invoke(cli, _command("validate", inputs["mt"], {}, inputs, str(tmp_path / "v.json")))
    assert result.exit_code == 2
    assert (
        f"{inputs['mt']}: a MaxText checkpoint carries no model config, which this command cannot take" in result.output
    )


@pytest.mark.parametrize("command", ["convert", "export", "train"])
def test_unknown_rope_layout_is_a_usage_error(inputs, tmp_path, command):
    config = os.path.join(inputs["hf"], "config.json")
    result = CliRunner().invoke(
        cli,
        _command(
            command, inputs["mt"], {"model_config": config, "rope_layout": "diagonal"}, inputs, str(tmp_path / "out")
        ),
    )
    assert result.exit_code == 2 and "diagonal" in result.output
    with pytest.raises(NVFP4UsageError, match="rope_layout=diagonal: unknown RoPE layout"):
        from nvfp4tool.checkpoints import TRAIN_OPTIONS

        open_checkpoint(inputs["mt"], model_config=config, rope_layout="diagonal", options=TRAIN_OPTIONS)


def test_step_needs_a_training_run(inputs, tmp_path):
    result = CliRunner().invoke(
        cli, ["export", inputs["hf"], "--out", str(tmp_path / "o"), "--step", "3", "--quant", "nvfp4-weight-only"]
    )
    assert result.exit_code == 2
    assert f"{inputs['hf']}: --step 3 needs an nvfp4tool training run" in result.output


def test_opened_kinds_and_maxtext_resolution(inputs):
    hf = open_checkpoint(inputs["hf"])
    assert (hf.kind, hf.path, hf.aux_dir, hf.run) == ("hf", inputs["hf"], inputs["hf"], None)
    mt = open_checkpoint(inputs["mt"], model_config=inputs["hf"], rope_layout="half")
    assert mt.kind == "maxtext" and mt.maxtext_rope_layout() == "half"
    assert mt.config.expected_tensor_shapes() == CONFIG.expected_tensor_shapes()
    for name in hf.tensors.names():
        np.testing.assert_array_equal(mt.tensors.get(name), hf.tensors.get(name), err_msg=name)


def test_run_steps_lists_usable_checkpoints_numerically(tmp_path):
    for step, with_state in ((12, True), (4, True), (8, False), (30, True)):
        os.makedirs(tmp_path / "checkpoints" / str(step) / ("state" if with_state else "meta"))
    (tmp_path / "checkpoints" / "tmp").mkdir()
    assert run_steps(str(tmp_path)) == [4, 12, 30]
