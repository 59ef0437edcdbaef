"""`nvfp4tool push` against a local Hub API server (tests/fixtures/hub_server.py) started inside each test.

What arrives must be exactly the export's files plus the generated README.md, byte for byte
(small files inline, large ones through the LFS batch + PUT path); a checkpoint that fails the
checker or has no validation report uploads nothing; server errors end in one line and exit 1;
a Hub that never answers ends in one line after the timeout and a bounded retry; --dry-run
contacts no server; the token never appears in the output nor, with -v, in any log record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.hub import PushOptions, push_checkpoint
from nvfp4tool.records.names import source_repo_id

from fixtures.hub_server import HubServer, SilentServer
from fixtures.serving_fixtures import build_checkpoint, write_checkpoint, write_export_record
from fixtures.validate_fixtures import validation_record

TOKEN = "hf_testTOKENdo-not-print-7f3a9c"  # distinctive, so a leak anywhere in output is found
REPO = "test-org/tiny-nvfp4"
LFS_THRESHOLD = 16 * 1024  # the test server sends files >= 16 KiB through LFS


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """HF_TOKEN set, no saved login, Xet off (the client would use Xet whenever hf_xet is
    installed, and the test servers speak plain LFS only). huggingface_hub 2.4 fetches an "agent
    harnesses" registry from huggingface.co once per process: preset it so that nothing but the
    local test servers is ever contacted."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _detect_agent

    monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture
def hub(hub_env):
    """A running test Hub (see hub_env)."""
    with HubServer(lfs_threshold=LFS_THRESHOLD) as server:
        yield server


@pytest.fixture
def all_logs():
    """Every log record of every logger (ours, huggingface_hub, httpx2/httpcore2, ...) at DEBUG,
    formatted with its exception text: a list of (logger name, text). Levels restored after."""
    import httpx2  # noqa: F401 (their loggers exist before the handler is installed)
    import huggingface_hub  # noqa: F401

    records: list[tuple[str, str]] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append((record.name, self.format(record)))

    handler = Collect(logging.DEBUG)
    loggers = [logging.root] + [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    saved = [(lg, lg.level, lg.propagate, lg.disabled) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.propagate, lg.disabled = lg is not logging.root or lg.propagate, False
    logging.root.addHandler(handler)
    yield records
    logging.root.removeHandler(handler)
    for lg, level, propagate, disabled in saved:
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


@pytest.fixture
def export(tmp_path):
    return _write_export(tmp_path / "export", "compressed-tensors")


def _write_export(
    folder, fmt, *, validation=True, passed=True, broken=False, quant="nvfp4", source_name="meta-llama/Llama-3.2-1B"
):
    ckpt = build_checkpoint(fmt, quant)
    if broken:  # a zero global scale: loads in every engine and serves garbage
        name = "model.layers.0.mlp.down_proj." + (
            "weight_global_scale" if fmt == "compressed-tensors" else "weight_scale_2"
        )
        ckpt.tensors[name] = np.zeros_like(ckpt.tensors[name])
    folder = write_checkpoint(folder, ckpt)
    write_export_record(folder, ckpt, fmt, quant, source_name=source_name)
    _write_json(os.path.join(folder, "tokenizer_config.json"), {"model_max_length": 128})
    os.makedirs(os.path.join(folder, "plots"))
    with open(os.path.join(folder, "plots", "sqnr.png"), "wb") as f:  # nested and LFS-sized
        f.write(np.random.default_rng(0).bytes(3 * LFS_THRESHOLD))
    if validation:
        bind_validation(folder, passed=passed)
    return folder


def bind_validation(folder, *, passed=True, **changes):
    """Write validation.json (+ validation.md, as validate renders it) for `folder` as it is now: a
    small passing record (`validate_fixtures.validation_record`, every metric and threshold filled
    in) whose export hashes are the folder's files and whose source is the provenance record's, as
    `nvfp4tool validate` would write it; `changes` replace record fields. Returns the record."""
    from nvfp4tool import formats
    from nvfp4tool.records.export import ExportRecord, sha256_file
    from nvfp4tool.records.validation import Named
    from nvfp4tool.validate.report import REPORT_FILES, markdown
    from nvfp4tool.validate.thresholds import defaults_for

    layout, provenance = formats.describe(folder), ExportRecord.read(folder)
    files = {
        rel: sha256_file(os.path.join(folder, rel))
        for rel in _folder_bytes(folder)
        if rel not in (*REPORT_FILES, "README.md")
    }
    base = validation_record(passed)
    metrics = {
        "kl_mean": 0.0123,
        "kl_p99": 0.05,
        "top1": 0.97,
        "ppl": 9.6,
        "ppl_increase": 0.0105,
        "logit_max_err": 0.5,
        "logit_mean_err": 0.01,
    }
    record = dataclasses.replace(
        base,
        **{
            "export": Named(os.path.basename(folder), files),
            "quant": layout.quant,
            "format": layout.format,
            "source": Named(provenance.source.name, dict(provenance.source.files)),
            "source_kind": provenance.source.kind,
            "source_step": provenance.source.step,
            "models": {"bf16": {"ppl": 9.5}, layout.quant: metrics},
            "layers": [
                dataclasses.replace(row, weight_sqnr_db={layout.quant: 20.5}, output_sqnr_db={layout.quant: 19.0})
                for row in base.layers
            ],
            "generation": dataclasses.replace(base.generation, first_divergence={layout.quant: [None, 5]}),
            "kl_histogram": {layout.quant: base.kl_histogram["nvfp4"]},
            "thresholds": dataclasses.asdict(defaults_for(layout.quant)),
            **changes,
        },
    )
    record.write(folder)
    with open(os.path.join(folder, "validation.md"), "w", encoding="utf-8") as f:
        f.write(markdown(record))
    return record


def _push(*args, verbose=False):
    runner = CliRunner()
    result = runner.invoke(cli, [*(["-v"] if verbose else []), "push", *args], catch_exceptions=False)
    assert TOKEN not in result.output
    return result


def _folder_bytes(folder):
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder).replace(os.sep, "/")] = f.read()
    return files


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


# ---------------------------------------------------------------------------------------- tests


def test_push_delivers_exactly_the_folder_plus_card(hub, export, all_logs):
    before = _folder_bytes(export)
    expected_card = push_checkpoint(export, PushOptions(repo_id=REPO, dry_run=True), echo=lambda _: None).card
    result = _push(export, "--repo-id", REPO, "--endpoint", hub.url, "--private", verbose=True)
    assert result.exit_code == 0, result.output
    http_logs = [text for name, text in all_logs if name.split(".")[0] in ("httpx2", "httpcore2", "huggingface_hub")]
    assert len(http_logs) > 10  # the HTTP libraries' debug logs were captured...
    assert not [text for _, text in all_logs if TOKEN in text]  # ...and none of them shows the token
    assert TOKEN not in result.stdout and TOKEN not in result.stderr
    assert _folder_bytes(export) == before  # the user's folder is untouched (no README.md added)
    received = hub.files[(REPO, "main")]
    assert received == {**before, "README.md": expected_card.encode("utf-8")}
    assert hub.repos[REPO]["private"] is True
    large = [p for p, data in before.items() if len(data) >= LFS_THRESHOLD]
    assert {"model.safetensors", "plots/sqnr.png"} <= set(large)  # (+ the export record, by its size)
    assert hub.routes_seen().count("lfs_put") == len(large)  # large files went through LFS, others inline
    assert set(hub.lfs_objects.values()) == {before[p] for p in large}
    assert hub.routes_seen().count("commit") == 1
    # every Hub API call carries the token; the LFS upload URL (a presigned URL on the real Hub) does not
    assert {auth for route, auth in hub.auth_headers if route != "lfs_put"} == {f"Bearer {TOKEN}"}
    assert {auth for route, auth in hub.auth_headers if route == "lfs_put"} == {""}
    assert "unknown" not in hub.routes_seen()


def test_own_readme_is_replaced_in_the_upload_only(hub, export):
    with open(os.path.join(export, "README.md"), "w") as f:
        f.write("my notes\n")
    result = _push(export, "--repo-id", REPO, "--endpoint", hub.url)
    assert result.exit_code == 0, result.output
    assert "replaced by the generated model card" in result.output
    with open(os.path.join(export, "README.md")) as f:
        assert f.read() == "my notes\n"
    assert hub.files[(REPO, "main")]["README.md"].startswith(b"---\nbase_model: meta-llama/Llama-3.2-1B\n")


def test_card_metadata_and_sections(export):
    card = push_checkpoint(
        export, PushOptions(repo_id=REPO, dry_run=True, license="llama3.2"), echo=lambda _: None
    ).card
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    meta = yaml.safe_load(front)
    assert meta == {
        "base_model": "meta-llama/Llama-3.2-1B",
        "base_model_relation": "quantized",
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "license": "llama3.2",
        "tags": ["nvfp4", "fp4", "w4a4", "compressed-tensors", "nvfp4tool"],
    }
    assert "| `model.layers.{0,1}.mlp.down_proj` | 2 |" in body  # 2 layers in the fixture, named
    assert "`lm_head`" in body
    assert "| KL mean (nats) | 0.0123 |" in body  # the table validate renders, under one heading
    assert body.count("## Validation") == 1
    assert f"vllm serve {REPO}\n" in body and f'AutoModelForCausalLM.from_pretrained("{REPO}")' in body


def test_card_without_validation_md_renders_the_record(export):
    with_md = push_checkpoint(export, PushOptions(repo_id=REPO, dry_run=True), echo=lambda _: None).card
    os.remove(os.path.join(export, "validation.md"))
    card = push_checkpoint(export, PushOptions(repo_id=REPO, dry_run=True), echo=lambda _: None).card
    assert card == with_md and "| KL mean (nats) | 0.0123 |" in card and "| top-1 agreement | 97.00% |" in card


def test_modelopt_card_serving_commands(tmp_path):
    folder = _write_export(tmp_path / "mo", "modelopt")
    card = push_checkpoint(
        folder, PushOptions(repo_id=REPO, dry_run=True, base_model="org/src"), echo=lambda _: None
    ).card
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "modelopt" and meta["base_model"] == "org/src"
    assert "modelopt" in meta["tags"] and "license" not in meta
    assert f"vllm serve {REPO} --quantization modelopt_fp4" in card and "trtllm-serve" in card


def test_source_repo_id():
    assert source_repo_id("/c/hub/models--meta-llama--Llama-3.2-1B/snapshots/ab12") == "meta-llama/Llama-3.2-1B"
    assert source_repo_id("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert source_repo_id("/data/llama-local") is None


def test_license_from_source_readme(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# src\n")
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    provenance_path = os.path.join(folder, "nvfp4tool_export.json")
    with open(provenance_path) as f:
        provenance = json.load(f)
    provenance["source"]["name"] = str(source)
    _write_json(provenance_path, provenance)
    bind_validation(folder)  # validated after the edit, of the renamed source
    card = push_checkpoint(folder, PushOptions(repo_id=REPO, dry_run=True), echo=lambda _: None).card
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["license"] == "apache-2.0" and "base_model" not in meta  # a local source names no repo


def test_failed_check_uploads_nothing(hub, tmp_path):
    folder = _write_export(tmp_path / "bad", "compressed-tensors", broken=True)
    result = _push(folder, "--repo-id", REPO, "--endpoint", hub.url)
    assert result.exit_code == 1
    assert "model.layers.0.mlp.down_proj" in result.output and "nothing uploaded" in result.output
    assert hub.requests == []


def test_missing_validation_refused_unless_no_validation(hub, tmp_path):
    folder = _write_export(tmp_path / "nv", "compressed-tensors", validation=False)
    refused = _push(folder, "--repo-id", REPO, "--endpoint", hub.url)
    assert refused.exit_code == 1 and "validation.json" in refused.output and "--no-validation" in refused.output
    assert hub.requests == []
    accepted = _push(folder, "--repo-id", REPO, "--endpoint", hub.url, "--no-validation")
    assert accepted.exit_code == 0, accepted.output
    card = hub.files[(REPO, "main")]["README.md"].decode()
    assert "Not validated" in card
    assert set(hub.files[(REPO, "main")]) == set(_folder_bytes(folder)) | {"README.md"}


def test_failed_validation_refused(hub, tmp_path):
    folder = _write_export(tmp_path / "fv", "compressed-tensors", passed=False)
    result = _push(folder, "--repo-id", REPO, "--endpoint", hub.url, "--no-validation")
    assert result.exit_code == 1 and "failed validation (kl_mean)" in result.output
    assert hub.requests == []


@pytest.mark.parametrize("fail, status", [({"commit": 500}, 500), ({"*": 401}, 401), ({"lfs_put": 413}, 413)])
def test_server_error_is_one_line_and_exit_1(hub, export, fail, status):
    hub.fail = fail
    result = _push(export, "--repo-id", REPO, "--endpoint", hub.url)
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"HTTP {status}" in errors[0] and REPO in errors[0], result.output
    assert "Traceback" not in result.output
    assert hub.files == {}


def test_hub_without_xet_gets_a_hint(hub, export, monkeypatch):
    """With hf_xet installed the client asks for a Xet write token first; this server has none."""
    pytest.importorskip("hf_xet")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    result = _push(export, "--repo-id", REPO, "--endpoint", hub.url)
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "xet-write-token" in errors[0] and "HF_HUB_DISABLE_XET=1" in errors[0]
    assert hub.files == {}


def test_revision_branch_and_pull_request(hub, export):
    on_branch = _push(export, "--repo-id", REPO, "--endpoint", hub.url, "--revision", "nvfp4-v2")
    assert on_branch.exit_code == 0, on_branch.output
    assert "nvfp4-v2" in hub.repos[REPO]["branches"] and (REPO, "nvfp4-v2") in hub.files
    as_pr = _push(export, "--repo-id", REPO, "--endpoint", hub.url, "--create-pr")
    assert as_pr.exit_code == 0, as_pr.output
    assert hub.commits[-1]["create_pr"] is True and "discussions" in as_pr.output
    both = _push(export, "--repo-id", REPO, "--endpoint", hub.url, "--create-pr", "--revision", "x")
    assert both.exit_code == 2


def test_dry_run_contacts_no_server_and_needs_no_token(hub, export, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    result = _push(export, "--repo-id", REPO, "--endpoint", hub.url, "--dry-run")
    assert result.exit_code == 0, result.output
    assert hub.requests == []
    assert "model.safetensors" in result.output and "README.md" in result.output
    assert "base_model_relation: quantized" in result.output


def test_no_token_is_a_clear_error(hub, export, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    result = _push(export, "--repo-id", REPO, "--endpoint", hub.url)
    assert result.exit_code == 1 and "HF_TOKEN" in result.output
    assert hub.requests == []


def test_bad_repo_id_is_usage_error(export):
    assert _push(export, "--repo-id", "no-slash", "--dry-run").exit_code == 2


def test_silent_hub_is_one_line_after_timeout_and_retries(hub_env, export, all_logs):
    """A Hub that accepts the connection and never answers: bounded time, one line, no token."""
    with SilentServer(lifetime=30) as silent:
        start = time.monotonic()
        result = _push(export, "--repo-id", REPO, "--endpoint", silent.url, "--timeout", "0.4", verbose=False)
        elapsed = time.monotonic() - start
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: {silent.url}: no answer after 0.4 s (3 tries); nothing more was sent to {REPO}"]
    assert "Traceback" not in result.output
    assert 3 * 0.4 <= elapsed < 15
    assert silent.connections >= 1
    assert not [text for _, text in all_logs if TOKEN in text]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_bad_timeout_is_usage_error(export, value):
    result = _push(export, "--repo-id", REPO, "--timeout", value, "--dry-run")
    assert result.exit_code == 2 and "--timeout" in result.output


def test_bad_endpoint_is_usage_error(export):
    result = _push(export, "--repo-id", REPO, "--endpoint", "localhost:8000")
    assert result.exit_code == 2 and "--endpoint" in result.output


def test_quiet_push_prints_only_the_result(hub, export):
    result = CliRunner().invoke(cli, ["--quiet", "push", export, "--repo-id", REPO, "--endpoint", hub.url])
    assert result.exit_code == 0, result.output
    # no check summary, no upload bars; the one warning the fixture earns (its source names no license) stays
    assert result.stderr.splitlines() == [
        "Warning: the model card has no license (none in the source's README.md or config.json); pass --license ID"
    ]
    assert result.stdout.startswith(f"uploaded to {REPO}:") and "done: " in result.stdout
