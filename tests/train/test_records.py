"""The typed records of the run and of validation: round trips, and every defect a RecordError
(exit 1 through the CLI) naming the file and the key."""

from __future__ import annotations

import json
import math

import pytest

from nvfp4tool.records import RecordError
from nvfp4tool.records.names import portable_name
from nvfp4tool.records.validation import ValidationRecord
from nvfp4tool.run.config import TrainConfig
from nvfp4tool.run.records import InputAmaxRecord, PrecisionMapRecord, RunRecord

from fixtures.validate_fixtures import validation_record


def _run_record(**config) -> RunRecord:
    return RunRecord(
        config=TrainConfig(data="corpus.txt", **config).to_dict(),
        model_config={"model_type": "llama"},
        data_sha256="a" * 64,
        eval_data_sha256=None,
        tokenizer_sha256="b" * 64,
        train_windows=10,
        eval_windows=1,
        devices=1,
        processes=1,
    )


@pytest.mark.parametrize(
    "recipe, weight_2d, block",
    [("nvfp4", True, "2d"), ("nvfp4", False, "1d"), ("fp8", True, "1d"), ("bf16", True, "1d")],
)
def test_run_record_round_trip_and_typed_weight_block(tmp_path, recipe, weight_2d, block):
    record = _run_record(recipe=recipe, weight_2d=weight_2d, bf16_patterns=("*.down_proj",))
    record.write(tmp_path)
    back = RunRecord.read(tmp_path)
    assert back == record
    assert back.weight_block == block
    assert back.train_config().bf16_patterns == ("*.down_proj",)
    assert back.recipe_config().name == recipe


def _mutated(tmp_path, mutate) -> str:
    obj = _run_record().to_json()
    mutate(obj)
    (tmp_path / RunRecord.FILE_NAME).write_text(json.dumps(obj))
    with pytest.raises(RecordError) as error:
        RunRecord.read(tmp_path)
    return str(error.value)


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda o: o.update(extra=1), "unknown key 'extra'"),
        (lambda o: o.pop("data_sha256"), "missing key 'data_sha256'"),
        (lambda o: o.update(devices="8"), "devices: expected an integer"),
        (lambda o: o["config"].update(weight_2dd=True), "config: unknown key 'weight_2dd'"),
        (lambda o: o["config"].pop("weight_2d"), "config: missing key 'weight_2d'"),
        (lambda o: o["config"].update(weight_2d="yes"), "config: weight_2d: expected a boolean"),
        (lambda o: o["config"].update(recipe="int8"), "config: train config: recipe='int8'"),
    ],
)
def test_run_record_defects_name_the_file_and_key(tmp_path, mutate, expected):
    message = _mutated(tmp_path, mutate)
    assert message.startswith(str(tmp_path / RunRecord.FILE_NAME)) and expected in message


@pytest.mark.parametrize(
    "record_cls, content, expected",
    [
        (InputAmaxRecord, {"a": 1.5, "b": 0}, None),
        (InputAmaxRecord, {"a": -1.0}, "a: input amax must be a finite number >= 0"),
        (InputAmaxRecord, {"a": "1.0"}, "a: expected a number"),
        (InputAmaxRecord, [1.0], "expected a JSON object"),
        (PrecisionMapRecord, {"a": "nvfp4", "lm_head": "bf16"}, None),
        (PrecisionMapRecord, {"a": "int8"}, "a: 'int8' is not a precision"),
    ],
)
def test_flat_map_records_keep_their_shape_and_read_strictly(tmp_path, record_cls, content, expected):
    path = tmp_path / record_cls.FILE_NAME
    path.write_text(json.dumps(content))
    if expected is None:
        (tmp_path / "copy").mkdir()
        record_cls.read(tmp_path).write(tmp_path / "copy")  # written back in the same flat shape
        assert json.loads((tmp_path / "copy" / record_cls.FILE_NAME).read_text()) == content
    else:
        with pytest.raises(RecordError, match=expected) as error:
            record_cls.read(tmp_path)
        assert str(error.value).startswith(str(path))


def test_non_finite_amax_is_refused_on_write(tmp_path):
    with pytest.raises(RecordError, match="input amax must be a finite number"):
        InputAmaxRecord({"a": math.nan}).write(tmp_path)
    assert not (tmp_path / InputAmaxRecord.FILE_NAME).exists()


def test_validation_record_keeps_non_finite_metrics_as_strings(tmp_path):
    record = validation_record(passed=False)
    broken = ValidationRecord(
        **{**record.__dict__, "models": {"bf16": {"ppl": math.inf}, "nvfp4": {"kl_mean": math.nan}}}
    )
    broken.write(tmp_path)
    text = (tmp_path / ValidationRecord.FILE_NAME).read_text()
    assert '"kl_mean": "nan"' in text and '"ppl": "inf"' in text and "NaN" not in text
    back = ValidationRecord.read(tmp_path)
    assert math.isnan(back.models["nvfp4"]["kl_mean"]) and back.models["bf16"]["ppl"] == math.inf
    assert back.failures == record.failures and not back.passed


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda o: o.pop("passed"), "missing key 'passed'"),
        (lambda o: o.update(metrics={}), "unknown key 'metrics'"),
        (lambda o: o["export"].update(path="/home/me/x"), "export: unknown key 'path'"),
        (lambda o: o["layers"][0]["weight_sqnr_db"].update(nvfp4="big"), "expected a number"),
        (lambda o: o["failures"].append({"metric": "x"}), "missing key"),
    ],
)
def test_validation_record_defects_name_the_file(tmp_path, mutate, expected):
    obj = validation_record(passed=True).to_json()
    mutate(obj)
    (tmp_path / ValidationRecord.FILE_NAME).write_text(json.dumps(obj))
    with pytest.raises(RecordError, match=expected) as error:
        ValidationRecord.read(tmp_path)
    assert str(error.value).startswith(str(tmp_path / ValidationRecord.FILE_NAME))


def test_portable_names():
    assert portable_name("/c/hub/models--meta-llama--Llama-3.2-1B/snapshots/ab12") == "meta-llama/Llama-3.2-1B"
    assert portable_name("/data/runs/llama-local/") == "llama-local"
    assert portable_name("/data/val.txt") == "val.txt"
