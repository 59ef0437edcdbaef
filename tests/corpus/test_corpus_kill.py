"""kill -9 of `data prepare` while its workers tokenize (tests/fixtures/kill_child.py, point
"tokens"): no cache appears, the orphaned workers exit, and the rerun removes the temporary folder,
says so, and writes the same cache as an uninterrupted prepare."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.corpus.prepare import prepare_cache
from nvfp4tool.records.corpus import CorpusManifest

from fixtures.kill_fixtures import kill_at

TAG = "NVFP4TOOL_PREPARE_KILL_TEST"  # in the killed command's environment, so its workers are found


def _tagged_processes(tag_value: str) -> list[int]:
    """Pids of live processes whose environment holds TAG=tag_value (the killed prepare's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{TAG}={tag_value}".encode() in environ.split(b"\0") and state != "Z":
            found.append(int(entry))
    return found


def test_kill_mid_prepare_then_rerun(tmp_path, monkeypatch, corpus_tokenizer):
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i}: " + "words " * (i % 7)}) + "\n" for i in range(2500)))
    out = tmp_path / "cache"
    args = ["data", "prepare", str(source), "--tokenizer", str(corpus_tokenizer), "--out", str(out)]
    args += ["--workers", "2", "--shard-tokens", "3000"]
    monkeypatch.setenv(TAG, str(tmp_path))
    temporary, pid = kill_at("tokens", args, tmp_path / "ready")
    assert Path(temporary).name.startswith(".cache.tmp-") and Path(temporary).is_dir()
    assert any(Path(temporary).glob("tokens-*.bin")) and not out.exists()
    deadline = time.monotonic() + 30
    while _tagged_processes(str(tmp_path)) and time.monotonic() < deadline:  # workers notice their parent is gone
        time.sleep(0.2)
    assert not _tagged_processes(str(tmp_path)), "the killed prepare's workers are still running"

    result = CliRunner().invoke(cli, ["--log-format", "text", *args])
    assert result.exit_code == 0, result.output
    assert f"removed {temporary}: temporary folder of an interrupted run (pid {pid})" in result.output
    done = [line for line in result.output.splitlines() if "prepare: done, 2500 document" in line]
    assert len(done) == 1 and " MB/s" in done[0] and "tokens/s" in done[0], result.output  # the progress line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "d.jsonl", "ready"]
    prepare_cache([source], corpus_tokenizer, tmp_path / "again", workers=0, shard_tokens=3000)
    for file in sorted(os.listdir(out)):
        if file != CorpusManifest.FILE_NAME:
            assert (out / file).read_bytes() == (tmp_path / "again" / file).read_bytes(), file
    killed_and_rerun, uninterrupted = CorpusManifest.read(out), CorpusManifest.read(tmp_path / "again")
    assert [s.sha256 for s in killed_and_rerun.shards] == [s.sha256 for s in uninterrupted.shards]
    assert killed_and_rerun.documents == uninterrupted.documents == 2500
