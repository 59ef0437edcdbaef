"""The token cache (`data prepare`): its windows against an independent numpy packing of the same
documents for every source kind and both token dtypes, byte-identical output for any number of
workers, segment ids and loss marks against numpy oracles, and bad input refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer, models, pre_tokenizers

from nvfp4tool.cli import cli
from nvfp4tool.corpus import encode
from nvfp4tool.corpus.cache import open_cache, verify_cache
from nvfp4tool.corpus.encode import DataFormat, encode_documents
from nvfp4tool.corpus.prepare import prepare_cache
from nvfp4tool.corpus.sources import embedded_corpus, iter_documents
from nvfp4tool.corpus.tokenizer import load_tokenizer
from nvfp4tool.corpus.windows import windows_in_memory
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.corpus import CorpusManifest, token_dtype

SEQ = 16
SHARD = 700  # tokens per shard: windows run across shard ends


def _documents() -> list[str]:
    """~60 documents of unequal length cut from the embedded validation text."""
    text = embedded_corpus()[1].read_text(encoding="utf-8")[:24000]
    cuts = np.cumsum(np.random.default_rng(0).integers(40, 700, size=80))
    cuts = cuts[cuts < len(text)].tolist()
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


DOCS = _documents()


def _write_sources(folder: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents as a folder of .txt files, a JSONL file, a Parquet file and a dataset."""
    import datasets

    (folder / "txt").mkdir(parents=True)
    for i, doc in enumerate(docs):
        (folder / "txt" / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    (folder / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    pq.write_table(pa.table({"text": docs}), folder / "d.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).save_to_disk(
        str(folder / "saved"), max_shard_size="8KB"
    )
    return {
        "txt": folder / "txt",
        "jsonl": folder / "d.jsonl",
        "parquet": folder / "d.parquet",
        "saved": folder / "saved",
    }


def _stream(tokenizer: Tokenizer, eos_id: int, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The oracle: each document's ids (tokenizers, one at a time) then eos; each token's document."""
    ids = [tokenizer.encode(d, add_special_tokens=False).ids + [eos_id] for d in docs]
    return np.concatenate(ids).astype(np.int64), np.repeat(np.arange(len(ids)), [len(i) for i in ids])


def _oracle_windows(stream: np.ndarray, seq: int) -> np.ndarray:
    """pack_windows as nvfp4tool cut windows before the cache: rows of seq + 1, shifted by seq."""
    count = (len(stream) - 1) // seq
    return stream[np.arange(count)[:, None] * seq + np.arange(seq + 1)[None, :]]


def _all_rows(windows):
    return windows.rows(np.arange(len(windows)))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return _write_sources(tmp_path_factory.mktemp("sources"), DOCS)


@pytest.fixture(scope="module")
def jsonl_cache(tmp_path_factory, sources, corpus_tokenizer):
    out = tmp_path_factory.mktemp("caches") / "jsonl"
    prepare_cache([sources["jsonl"]], corpus_tokenizer, out, workers=0, shard_tokens=SHARD)
    return out


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "saved"])
def test_cache_windows_equal_the_old_packing(tmp_path, sources, corpus_tokenizer, kind):
    tokenizer = load_tokenizer(corpus_tokenizer)
    stream, document = _stream(tokenizer.tokenizer, tokenizer.eos_id, DOCS)
    expected = _oracle_windows(stream, SEQ)
    manifest = prepare_cache([sources[kind]], corpus_tokenizer, tmp_path / "c", workers=0, shard_tokens=SHARD)
    assert (manifest.dtype, manifest.documents, manifest.tokens) == ("uint16", len(DOCS), len(stream))
    assert len(manifest.shards) == -(-len(stream) // SHARD)
    cache = open_cache(tmp_path / "c")
    batch = _all_rows(cache.windows(SEQ, "concat"))
    assert batch.tokens.dtype == np.int32 and batch.segments is None and batch.loss is None
    np.testing.assert_array_equal(batch.tokens, expected)
    np.testing.assert_array_equal(cache.starts, np.flatnonzero(np.diff(document, prepend=-1)))  # first tokens
    in_memory = windows_in_memory(encode_documents(tokenizer, iter_documents(sources[kind])), SEQ)
    np.testing.assert_array_equal(_all_rows(in_memory).tokens, expected)
    if kind == "txt":  # a folder's files are named inside the folder as given
        assert [s.name for s in manifest.sources][:2] == [
            str(sources[kind] / "000.txt"),
            str(sources[kind] / "001.txt"),
        ]


def test_segments_and_eval_split_against_an_oracle(jsonl_cache, corpus_tokenizer):
    tokenizer = load_tokenizer(corpus_tokenizer)
    stream, document = _stream(tokenizer.tokenizer, tokenizer.eos_id, DOCS)
    train, held_out = open_cache(jsonl_cache).windows(SEQ, "segmented").split(0.1)
    count = (len(stream) - 1) // SEQ
    num_eval = max(1, round(count * 0.1))
    assert (len(train), len(held_out)) == (count - num_eval, num_eval)
    for windows, first in ((train, 0), (held_out, count - num_eval)):
        picked = np.array([len(windows) - 1, 0, len(windows) // 2])
        batch = windows.rows(picked)
        positions = (first + picked)[:, None] * SEQ + np.arange(SEQ + 1)[None, :]
        np.testing.assert_array_equal(batch.tokens, stream[positions])
        for row, pos in zip(batch.segments, positions):  # renumber each row's documents 1, 2, ...
            docs = document[pos]
            order = {d: n for n, d in enumerate(dict.fromkeys(docs.tolist()), 1)}
            assert row.tolist() == [order[d] for d in docs.tolist()]
    assert train.rows(np.arange(len(train))).segments.max() > 1  # rows do hold several documents


def test_workers_write_the_same_bytes(tmp_path, sources, corpus_tokenizer):
    for workers in (1, 2):
        result = CliRunner().invoke(
            cli,
            ["-q", "data", "prepare", str(sources["jsonl"]), str(sources["txt"]), "--tokenizer", str(corpus_tokenizer),
             "--out", str(tmp_path / f"w{workers}"), "--workers", str(workers), "--shard-tokens", str(SHARD)],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
    names = sorted(os.listdir(tmp_path / "w1"))
    assert names == sorted(os.listdir(tmp_path / "w2")) and "documents.npy" in names
    for name in names:
        one, two = (tmp_path / "w1" / name).read_bytes(), (tmp_path / "w2" / name).read_bytes()
        if name == CorpusManifest.FILE_NAME:  # equal but for the files' modification times
            one, two = (_without_mtimes(json.loads(x)) for x in (one, two))
        assert one == two, name
    manifest = CorpusManifest.read(tmp_path / "w2")
    assert manifest.documents == 2 * len(DOCS) and [s.documents for s in manifest.sources][:2] == [len(DOCS), 1]


def _without_mtimes(obj):
    if isinstance(obj, dict):
        return {k: _without_mtimes(v) for k, v in obj.items() if k != "mtime_ns"}
    return [_without_mtimes(v) for v in obj] if isinstance(obj, list) else obj


def test_token_dtype_rule_and_a_uint32_cache(tmp_path):
    assert [token_dtype(n) for n in (384, 65535, 65536, 65537)] == ["uint16", "uint16", "uint16", "uint32"]
    vocab = {f"w{i}": i for i in range(70000)}  # a word-level tokenizer with ids past 65535
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w69999"}))
    rng = np.random.default_rng(1)
    docs = [" ".join(f"w{i}" for i in rng.integers(60000, 69999, size=rng.integers(3, 40))) for _ in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    manifest = prepare_cache([tmp_path / "d.jsonl"], tmp_path / "tok", tmp_path / "c", workers=0, shard_tokens=100)
    assert manifest.dtype == "uint32" and manifest.shards[0].bytes == 400
    stream, _ = _stream(tokenizer, 69999, docs)
    assert stream.max() > 65535
    np.testing.assert_array_equal(
        _all_rows(open_cache(tmp_path / "c").windows(SEQ)).tokens, _oracle_windows(stream, SEQ)
    )


def test_a_format_with_loss_marks_stores_them_aligned(tmp_path, monkeypatch, sources, corpus_tokenizer):
    """A data format returning marks (here: every third token of a document) gets a loss file per
    shard; the rows' loss equals the marks cut like the tokens (each end-of-text id marked)."""

    def marked(tokenizer, documents, sft):
        encoded, _ = encode.FORMATS["text"].encode(tokenizer, documents, sft)
        return [(ids, [i % 3 == 0 for i in range(len(ids))]) for ids, _ in encoded], None

    monkeypatch.setitem(encode.FORMATS, "marked", DataFormat("marked", iter_documents, marked, len))
    manifest = prepare_cache(
        [sources["jsonl"]], corpus_tokenizer, tmp_path / "c", format="marked", workers=0, shard_tokens=SHARD
    )
    assert manifest.has_loss and all(s.loss.bytes == s.tokens for s in manifest.shards)
    tokenizer = load_tokenizer(corpus_tokenizer)
    ids = [tokenizer.tokenizer.encode(d, add_special_tokens=False).ids for d in DOCS]
    marks = np.concatenate([[i % 3 == 0 for i in range(len(d))] + [True] for d in ids])
    batch = _all_rows(open_cache(tmp_path / "c").windows(SEQ, "segmented"))
    np.testing.assert_array_equal(batch.loss, _oracle_windows(marks, SEQ))


# ------------------------------------------------------------------------------------------
# bad input: one line naming the file, the right exit code, nothing created or destroyed


def _cli(*args):
    return CliRunner().invoke(cli, [*map(str, args)])


def _one_line_error(result, code, *fragments):
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 or result.output.count("Error") == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


@pytest.fixture
def cache_copy(tmp_path, jsonl_cache):
    import shutil

    shutil.copytree(jsonl_cache, tmp_path / "cache", copy_function=shutil.copy2)  # mtimes kept
    return tmp_path / "cache"


def test_truncated_or_extended_shard_is_refused(cache_copy):
    shard = cache_copy / "tokens-00001.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    with pytest.raises(NVFP4ToolError, match=r"tokens-00001.bin: \d+ bytes, the manifest records"):
        open_cache(cache_copy)
    _one_line_error(_cli("data", "verify", cache_copy), 1, "tokens-00001.bin", "truncated or extended")
    shard.write_bytes(data + b"\0\0")
    _one_line_error(_cli("data", "verify", cache_copy), 1, "tokens-00001.bin")


def test_edited_shard_of_the_same_size_is_refused(cache_copy):
    shard = cache_copy / "tokens-00002.bin"
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(NVFP4ToolError, match=r"tokens-00002.bin: sha256 differs"):  # its mtime moved
        open_cache(cache_copy)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # an edit that kept the mtime: verify finds it
    open_cache(cache_copy)
    _one_line_error(_cli("data", "verify", cache_copy, "--skip-sources"), 1, "tokens-00002.bin: sha256 differs")


def test_edited_manifest_is_refused(cache_copy):
    path = cache_copy / CorpusManifest.FILE_NAME
    manifest = json.loads(path.read_text())
    manifest["tokens"] += 1
    path.write_text(json.dumps(manifest))
    _one_line_error(_cli("data", "verify", cache_copy), 1, f"{CorpusManifest.FILE_NAME}: tokens:")
    manifest["tokens"] -= 1
    manifest["shards"][0]["file"] = "../outside.bin"
    path.write_text(json.dumps(manifest))
    _one_line_error(_cli("data", "verify", cache_copy), 1, "is not a file name inside the cache folder")
    path.write_bytes(b"\x89PNG")
    _one_line_error(_cli("data", "verify", cache_copy), 1, CorpusManifest.FILE_NAME)


def test_changed_source_is_named_by_verify(tmp_path, corpus_tokenizer):
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20]))
    prepare_cache([source], corpus_tokenizer, tmp_path / "c", workers=0)
    verify_cache(tmp_path / "c")
    assert "unchanged" in _cli("data", "verify", tmp_path / "c").output
    source.write_text(source.read_text().replace("e", "E", 1))
    _one_line_error(_cli("data", "verify", tmp_path / "c"), 1, f"{source}: changed since")
    assert _cli("data", "verify", tmp_path / "c", "--skip-sources").exit_code == 0
    source.unlink()
    _one_line_error(_cli("data", "verify", tmp_path / "c"), 1, f"{source}: a source of")


def _jsonl(docs: list[str]) -> str:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs)


def test_verify_finds_relative_sources_from_the_cache_in_any_folder(tmp_path, monkeypatch, corpus_tokenizer):
    """A source given to prepare as a relative path is recorded relative to the cache folder, so
    `data verify` run from another folder checks the same files (resolved from the current folder,
    it called them missing, or hashed a decoy of the same name there); an absolute source stays
    absolute; a manifest written before `path_from_cache` resolves the name from the current folder."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "src" / "parts").mkdir(parents=True)
    (elsewhere / "src").mkdir(parents=True)
    (project / "src" / "d.jsonl").write_text(_jsonl(DOCS[:10]))
    for i, doc in enumerate(DOCS[10:12]):
        (project / "src" / "parts" / f"{i}.txt").write_text(doc)
    absolute = tmp_path / "abs.jsonl"
    absolute.write_text(_jsonl(DOCS[12:16]))
    (elsewhere / "src" / "d.jsonl").write_text(_jsonl(DOCS[:9]))  # a decoy where cwd-relative names lead
    monkeypatch.chdir(project)
    prepare_cache(["src/d.jsonl", "src/parts", absolute], corpus_tokenizer, "out/cache", workers=0)
    cache = project / "out" / "cache"
    assert [(s.name, s.path_from_cache) for s in CorpusManifest.read(cache).sources] == [
        ("src/d.jsonl", "../../src/d.jsonl"),
        ("src/parts/0.txt", "../../src/parts/0.txt"),
        ("src/parts/1.txt", "../../src/parts/1.txt"),
        (str(absolute), str(absolute)),
    ]
    monkeypatch.chdir(elsewhere)
    for given in (cache, Path("..") / "project" / "out" / "cache"):  # the cache named absolute or relative
        result = _cli("data", "verify", given)
        assert result.exit_code == 0 and "its 4 source file(s) unchanged" in result.output, result.output
    (project / "src" / "d.jsonl").write_text(_jsonl(DOCS[:9]))
    _one_line_error(_cli("data", "verify", cache), 1, f"{cache}/../../src/d.jsonl: changed since {cache}")
    (project / "src" / "d.jsonl").unlink()
    _one_line_error(
        _cli("data", "verify", cache), 1, f"{cache}/../../src/d.jsonl: a source of", "given to prepare as src/d.jsonl"
    )
    # a manifest without `path_from_cache` (written before it): the name from the current folder, as before
    manifest = json.loads(Path(CorpusManifest.path(cache)).read_text())
    for source in manifest["sources"]:
        del source["path_from_cache"]
    Path(CorpusManifest.path(cache)).write_text(json.dumps(manifest))
    (project / "src" / "d.jsonl").write_text(_jsonl(DOCS[:10]))
    _one_line_error(_cli("data", "verify", cache), 1, "src/d.jsonl: changed since")  # the decoy
    monkeypatch.chdir(project)
    assert _cli("data", "verify", cache).exit_code == 0
    monkeypatch.chdir(tmp_path)
    _one_line_error(
        _cli("data", "verify", cache), 1, "src/d.jsonl: a source of", "relative to the folder prepare ran in"
    )


def test_prepare_refuses_bad_input_and_creates_nothing(tmp_path, sources, corpus_tokenizer, jsonl_cache):
    prepare = ["data", "prepare", "--tokenizer", corpus_tokenizer]
    out = tmp_path / "out"
    _one_line_error(_cli(*prepare, tmp_path / "missing.jsonl", "--out", out), 2, "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n' + bytes(range(0x80, 0x90)) + b"\n")
    _one_line_error(_cli(*prepare, sources["jsonl"], bad, "--out", out), 1, "bad.jsonl:2: not UTF-8 text")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "x"}\n')
    _one_line_error(_cli(*prepare, nofield, "--out", out), 1, "nofield.jsonl:1: no string field 'text'")
    _one_line_error(
        _cli(*prepare, sources["saved"], "--text-field", "body", "--out", out), 1, "saved: no column 'body'"
    )
    _one_line_error(_cli(*prepare, sources["txt"], "--out", sources["txt"] / "inside"), 2, "lies inside the input")
    assert not out.exists() and not (sources["txt"] / "inside").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left
    before = {p.name: p.read_bytes() for p in jsonl_cache.iterdir()}
    _one_line_error(_cli(*prepare, sources["jsonl"], "--out", jsonl_cache), 1, "already exists")
    assert {p.name: p.read_bytes() for p in jsonl_cache.iterdir()} == before
