"""`train data=CACHE`: the same losses as the run on the text it was prepared from (packing=concat),
the cache's manifest hash in run.json, and a resume on another cache or a run with another
tokenizer refused in one line naming the cache."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.corpus.cache import manifest_sha256
from nvfp4tool.corpus.prepare import prepare_cache
from nvfp4tool.corpus.sources import embedded_corpus, iter_documents
from nvfp4tool.corpus.tokenizer import load_tokenizer, tokenizer_sha256, train_bpe_tokenizer
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.corpus import CorpusManifest
from nvfp4tool.run.config import NEW_RUN_PACKING, load_train_config
from nvfp4tool.run.records import RunRecord
from nvfp4tool.train import trainer

from fixtures.train_fixtures import run_train, train_args

STEPS = 4


@pytest.fixture(scope="module")
def caches(tmp_path_factory, corpus_tokenizer):
    """The embedded train and validation text, each prepared into a cache (2 workers for one)."""
    folder = tmp_path_factory.mktemp("caches")
    train_txt, val_txt = embedded_corpus()
    prepare_cache([train_txt], corpus_tokenizer, folder / "train", workers=2, shard_tokens=5000)
    prepare_cache([val_txt], corpus_tokenizer, folder / "val", workers=0)
    return folder


def test_train_on_a_cache_reproduces_the_text_run(tmp_path, caches, corpus_tokenizer):
    text = run_train(corpus_tokenizer, tmp_path / "text", steps=STEPS, packing="concat")
    cached = run_train(
        corpus_tokenizer,
        tmp_path / "cached",
        steps=STEPS,
        packing="concat",
        data=caches / "train",
        eval_data=caches / "val",
    )
    assert list(cached.losses) == list(range(1, STEPS + 1))
    assert cached.losses == text.losses and cached.eval_losses == text.eval_losses  # bit for bit
    record = RunRecord.read(tmp_path / "cached")
    assert record.data_sha256 == manifest_sha256(caches / "train")
    assert record.eval_data_sha256 == manifest_sha256(caches / "val")
    assert record.config["packing"] == "concat" and record.packing == "concat"
    assert record.train_windows == RunRecord.read(tmp_path / "text").train_windows

    # a resume on another cache is refused before anything changes
    resume = train_args(
        corpus_tokenizer, tmp_path / "cached", steps=STEPS, packing="concat", resume="true", data=caches / "val"
    )
    result = CliRunner().invoke(cli, ["train", *resume, f"eval_data={caches / 'val'}"])
    assert result.exit_code == 1 and "the training data" in result.output, result.output

    # a run.json written before the packing key reads as concat: its resume continues concat, and
    # refuses segmented; a new run that does not say is segmented
    saved = json.loads((tmp_path / "cached" / RunRecord.FILE_NAME).read_text())
    del saved["config"]["packing"]
    legacy = RunRecord.from_json(saved)
    assert legacy.packing == "concat"
    same = load_train_config(None, train_args(corpus_tokenizer, tmp_path / "cached", steps=STEPS, resume="true"))
    assert same.packing is None and NEW_RUN_PACKING == "segmented"
    trainer._check_same_config(legacy, dataclasses.replace(same, packing=legacy.packing), tmp_path / "cached")
    with pytest.raises(NVFP4ToolError, match="packing 'concat' -> 'segmented'"):
        trainer._check_same_config(legacy, dataclasses.replace(same, packing="segmented"), tmp_path / "cached")


def test_another_tokenizer_is_refused_naming_the_cache(tmp_path, caches, corpus_tokenizer):
    other = tmp_path / "other-tokenizer"
    train_bpe_tokenizer(iter_documents(embedded_corpus()[1]), 300, other)
    args = train_args(other, tmp_path / "run", steps=STEPS, packing="concat", data=caches / "train")
    result = CliRunner().invoke(cli, ["train", *args])
    expected = CorpusManifest.read(caches / "train").tokenizer_sha256
    theirs = tokenizer_sha256(load_tokenizer(other))
    assert result.exit_code == 1, result.output
    assert f"data={caches / 'train'}: prepared with another tokenizer" in result.output
    assert expected in result.output and theirs in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "run").exists()
    tokenizer_train = train_args(corpus_tokenizer, tmp_path / "run", data=caches / "train", tokenizer="train")
    result = CliRunner().invoke(cli, ["train", *tokenizer_train])
    assert result.exit_code == 2 and "is a token cache" in result.output, result.output
    with pytest.raises(NVFP4ToolError, match="prepared with another tokenizer"):
        run_train(other, tmp_path / "run", data=caches / "train")
