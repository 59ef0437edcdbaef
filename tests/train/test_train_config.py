"""`nvfp4tool train`'s key=value / YAML configuration: every bad key or value is a usage error (exit
2) naming the key, raised before anything is created; a bad YAML file is one line naming it."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.run.config import TrainConfig, load_train_config


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("some words to train on\n" * 20)
    return str(path)


# (override, key the message must name): each alone on top of a valid `data=`
BAD_OVERRIDES = [
    ("steps=0", "steps"),
    ("steps=-3", "steps"),
    ("steps=1.5", "steps"),
    ("steps=many", "steps"),
    ("seq_len=0", "seq_len"),
    ("batch_size=0", "batch_size"),
    ("grad_accum=0", "grad_accum"),
    ("batch_size=6 grad_accum=4", "batch_size"),
    ("amax_history=0", "amax_history"),
    ("eval_batches=0", "eval_batches"),
    ("keep_checkpoints=0", "keep_checkpoints"),
    ("vocab_size=0", "vocab_size"),
    ("warmup_steps=-1", "warmup_steps"),
    ("eval_every=-1", "eval_every"),
    ("checkpoint_every=-5", "checkpoint_every"),
    ("seed=-1", "seed"),
    ("lr=0", "lr"),
    ("lr=-1e-3", "lr"),
    ("lr=nan", "lr"),
    ("lr=.inf", "lr"),
    ("lr=fast", "lr"),
    ("eps=0", "eps"),
    ("clip_norm=0", "clip_norm"),
    ("weight_decay=-0.1", "weight_decay"),
    ("min_lr_ratio=1.5", "min_lr_ratio"),
    ("decay_fraction=-0.1", "decay_fraction"),
    ("beta1=1", "beta1"),
    ("beta2=-0.5", "beta2"),
    ("eval_fraction=0", "eval_fraction"),
    ("eval_fraction=1", "eval_fraction"),
    ("eval_fraction=1.5", "eval_fraction"),
    ("recipe=fp4", "recipe"),
    ("schedule=linear", "schedule"),
    ("on_nonfinite=ignore", "on_nonfinite"),
    ("switch_scope=backward", "switch_scope"),
    ("rope_layout=sideways", "rope_layout"),
    ("switch_to_bf16_at=0", "switch_to_bf16_at"),
    ("switch_to_bf16_at=500", "switch_to_bf16_at"),
    ("switch_to_bf16_at=2.5", "switch_to_bf16_at"),
    ("bf16_first_layers=-1", "bf16_first_layers"),
    ("bf16_last_layers=-2", "bf16_last_layers"),
    ("mesh_data=0", "mesh_data"),
    ("mesh_fsdp=0", "mesh_fsdp"),
    ("num_processes=0", "num_processes"),
    ("num_processes=2", "coordinator_address"),
    ("process_id=1", "process_id"),
    ("resume=maybe", "resume"),
    ("force=2", "force"),
    ("rht=[1]", "rht"),
    ("steps=[1,", "steps"),
    ("bf16_patterns=[1,2]", "bf16_patterns"),
    ("text_field=", "text_field"),  # model=: the checkpoint opener, tests/converters/test_checkpoints.py
    ("tokenizer=no/such/folder", "tokenizer"),
    ("eval_data=missing.txt", "eval_data"),
    ("stepz=10", "stepz"),
    ("=3", "'=3'"),
    ("steps", "'steps'"),
    ("distill=kl", "distill"),
    ("teacher=t", "teacher"),
    ("distill=mse teacher=t", "distill"),
    ("temperature=0", "temperature"),
    ("temperature=-1", "temperature"),
    ("distill_weight=1.5", "distill_weight"),
    ("distill_weight=-0.1", "distill_weight"),
]


@pytest.mark.parametrize("override, key", BAD_OVERRIDES)
def test_bad_override_is_a_usage_error_naming_the_key(data, override, key):
    with pytest.raises(NVFP4UsageError, match=key):
        load_train_config(None, [f"data={data}", *override.split(" ")])


def test_missing_data_names_the_key():
    with pytest.raises(NVFP4UsageError, match="data='missing.txt': not found"):
        load_train_config(None, ["data=missing.txt"])
    with pytest.raises(NVFP4UsageError, match="data=PATH is required"):
        load_train_config(None, ["steps=3"])


def test_text_keys_take_the_text_as_typed(data, tmp_path):
    """YAML would read `yes` as True and `*.mlp.*` as an alias: paths and patterns are kept as typed."""
    folder = tmp_path / "yes"
    folder.mkdir()
    (folder / "a.txt").write_text("text")
    config = load_train_config(
        None,
        [
            f"data={folder}",
            "bf16_patterns=*.mlp.*",
            "out=on",
            "lr=3e-4",
            "switch_to_bf16_at=0.9",
            "bf16_last_layers=",
            "steps=20",
        ],
    )
    assert config.data == str(folder) and config.out == "on" and config.bf16_patterns == ("*.mlp.*",)
    assert config.lr == 3e-4 and config.switch_to_bf16_at == 0.9 and config.bf16_last_layers is None
    listed = load_train_config(None, [f"data={data}", "bf16_patterns=[a*, '*b']"])
    assert listed.bf16_patterns == ("a*", "*b")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("steps: [1, 2\n", r"run.yaml:2: invalid YAML"),
        ("steps: 3\nlr: 1e-3\nrecipe: : nvfp4\n", r"run.yaml:3: invalid YAML"),
        ("- steps\n- 3\n", "expected a mapping"),
        (b"steps: 3\n\xff\xfe\x00binary", r"run.yaml: not UTF-8"),
    ],
)
def test_bad_yaml_file_is_one_line_naming_file_and_line(tmp_path, data, text, fragment):
    path = tmp_path / "run.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(NVFP4ToolError, match=fragment) as caught:
        load_train_config(str(path), [f"data={data}"])
    assert not isinstance(caught.value, NVFP4UsageError)  # a bad file: exit 1
    assert "\n" not in str(caught.value)


def test_yaml_values_are_checked_like_overrides(tmp_path, data):
    path = tmp_path / "run.yaml"
    path.write_text(f"data: {data}\nsteps: 0\n")
    with pytest.raises(NVFP4UsageError, match="steps=0"):
        load_train_config(str(path), [])
    path.write_text(f"data: {data}\nout: [a, b]\n")
    with pytest.raises(NVFP4UsageError, match="out="):
        load_train_config(str(path), [])
    with pytest.raises(NVFP4UsageError, match="not found"):
        load_train_config(str(tmp_path / "missing.yaml"), [f"data={data}"])
    with pytest.raises(NVFP4UsageError, match="is a folder"):
        load_train_config(str(tmp_path), [f"data={data}"])


def test_valid_config_builds(data):
    config = load_train_config(None, [f"data={data}", "recipe=nvfp4", "steps=10", "switch_to_bf16_at=8"])
    assert isinstance(config, TrainConfig) and config.switch_to_bf16_at == 8.0
    assert config.recipe_config().quantizer == "auto"
    config = load_train_config(None, [f"data={data}", "recipe=nvfp4", "quantizer=pallas"])
    assert config.recipe_config().quantizer == "pallas"  # -> NVFP4Options (make_linear)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["steps=0"], "steps=0"),
        (["lr=nan"], "lr="),
        (["eval_fraction=0"], "eval_fraction"),
        (["data=missing.txt"], "data='missing.txt'"),
        (["no_such_key=1"], "no_such_key"),
        (["remat=layer"], "remat='layer'"),
        (["quantizer=triton"], "quantizer='triton'"),
    ],
)
def test_cli_train_usage_errors_exit_2_and_create_nothing(tmp_path, data, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    argv = ["train", *([f"data={data}"] if not args[0].startswith("data=") else []), *args, "out=runs/a"]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output
    assert sorted(os.listdir(tmp_path)) == before
