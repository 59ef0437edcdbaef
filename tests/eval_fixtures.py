"""The tiny model the eval tests run: a Llama (hidden 64, 2 layers, BF16 safetensors) with a byte-level
BPE tokenizer trained on Shakespeare, its NVFP4 W4A4 and FP8 exports (made by the CLI, calibrated
on the same ids), and a second, different model (its own tokenizer) with its FP8 export, for the
refusals. `build_eval_models(root)` builds them all (~20 s); the session fixture `eval_models`
builds them once per test process."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

VOCAB = 300
TASKS = ("nvfp4tool_mc", "nvfp4tool_mc_letter", "nvfp4tool_gsm", "nvfp4tool_text")


def write_tiny_llama(out_dir: str, *, seed: int, tokenizer_text: str | None = None) -> str:
    """A tiny Llama in BF16 (random weights drawn with numpy, norms around one, a large LM head so the
    logits are decisive: greedy choices far from ties between fp32 implementations) with its
    tokenizer (trained on `tokenizer_text`: Shakespeare by default), loadable by transformers."""
    from adversarial_harness import synthetic_config

    from converters.hf import write_safetensors
    from nvfp4tool.train.tokenizer import train_bpe_tokenizer

    if tokenizer_text is None:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "..", "nvfp4tool", "data", "shakespeare_train.txt"), encoding="utf-8") as f:
            tokenizer_text = f.read()[:50_000]
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = train_bpe_tokenizer([tokenizer_text], VOCAB, out_dir)
    config = synthetic_config(
        hidden=64,
        mlp=128,
        layers=2,
        vocab=tokenizer.vocab_size,
        head_dim=16,
        kv_heads=2,
        dtype="bfloat16",
        max_position_embeddings=256,
    )
    shapes = config.expected_tensor_shapes()
    rng = np.random.default_rng(seed)

    def make(name: str) -> np.ndarray:
        noise = rng.standard_normal(shapes[name], dtype=np.float32)
        scale = 0.5 if name == "lm_head.weight" else 0.08
        return (1.0 + 0.2 * noise if name.endswith("norm.weight") else scale * noise).astype(config.dtype)

    write_safetensors(
        os.path.join(out_dir, "model.safetensors"), [(n, config.dtype, s) for n, s in shapes.items()], make
    )
    hf = config.to_hf_config()
    hf.update(bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return out_dir


_BUILT: dict[str, str] = {}  # one build per test process, whichever module asks first


@pytest.fixture(scope="session")
def eval_models(tmp_path_factory) -> dict[str, str]:
    """The read-only models of the eval tests (`build_eval_models`), built once per process."""
    if not _BUILT:
        _BUILT.update(build_eval_models(str(tmp_path_factory.mktemp("eval-models"))))
    return dict(_BUILT)


def build_eval_models(root: str) -> dict[str, str]:
    paths = {
        "hf": os.path.join(root, "hf"),
        "ids": os.path.join(root, "ids.npy"),
        "nvfp4": os.path.join(root, "nvfp4"),
        "fp8": os.path.join(root, "fp8"),
        "other": os.path.join(root, "other"),
    }
    write_tiny_llama(paths["hf"], seed=5)
    np.save(paths["ids"], np.random.default_rng(0).integers(0, 256, (4, 32)))
    runner = CliRunner()
    for key, quant in (("nvfp4", "nvfp4"), ("fp8", "fp8")):
        result = runner.invoke(
            cli,
            [
                "-q",
                "export",
                paths["hf"],
                "--out",
                paths[key],
                "--quant",
                quant,
                "--calib-data",
                paths["ids"],
                "--calib-samples",
                "4",
                "--calib-seq-len",
                "32",
            ],
        )
        assert result.exit_code == 0, result.output
    write_tiny_llama(paths["other"], seed=6, tokenizer_text="A different corpus, a different tokenizer. " * 300)
    paths["other_fp8"] = os.path.join(root, "other_fp8")
    result = runner.invoke(
        cli,
        [
            "-q",
            "export",
            paths["other"],
            "--out",
            paths["other_fp8"],
            "--quant",
            "fp8",
            "--calib-data",
            paths["ids"],
            "--calib-samples",
            "4",
            "--calib-seq-len",
            "32",
        ],
    )
    assert result.exit_code == 0, result.output
    return paths


def write_eval_reports(export: str) -> None:
    """eval.json / eval_items.json / eval.md / eval.png for `export` with made-up per-item scores (no
    model runs): a record that names the export's present bytes, as `nvfp4tool eval` writes it."""
    from nvfp4tool.records.evaluation import EvalItems, EvalRecord
    from nvfp4tool.records.validation import Named
    from nvfp4tool.validate.custody import validated_files
    from nvfp4tool.validate.eval_report import write_reports
    from nvfp4tool.validate.evaluate import _paired_dict
    from nvfp4tool.validate.paired import mean_stderr, paired

    scores = {"bf16": np.array([1, 1, 0, 1, 0, 1.0]), "nvfp4": np.array([1, 0, 0, 1, 1, 1.0])}
    task = {
        "metric": "acc",
        "paired": {"nvfp4-bf16": _paired_dict(paired(scores["nvfp4"], scores["bf16"]))},
        **{k: {"acc": float(v.mean()), "n": len(v), "stderr": mean_stderr(v)} for k, v in scores.items()},
    }
    record = EvalRecord(
        export=Named.of(export, validated_files(export)),
        quant="nvfp4",
        source=Named(name="hf", sha256={}),
        reference=None,
        labels=["bf16", "nvfp4"],
        tasks={"nvfp4tool_mc": task},
        overall={"paired": {}},
        limit=6,
        seed=0,
        max_drop=None,
        failures=[],
        passed=True,
        lm_eval_version="0.4.13",
        resources={},
    )
    items = EvalItems(
        tasks={
            "nvfp4tool_mc": {
                "doc_id": list(range(6)),
                "prompt_hash": [str(i) for i in range(6)],
                **{k: v.tolist() for k, v in scores.items()},
            }
        }
    )
    write_reports(record, items, export)


def lm_eval_samples(model, model_args=None, *, limit: int, **kwargs) -> dict:
    """lm-eval's logged samples of the shipped offline tasks (`TASKS`) for `model` (an lm-eval
    model name with `model_args`, or an instance), the first `limit` items of each."""
    import lm_eval

    from nvfp4tool.validate.lm_backend import task_manager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=task_manager((), defaults=False),
        limit=limit,
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )
    return out["samples"]


def assert_samples_match(ours: dict, theirs: dict, limit: int) -> None:
    """Two backends' samples of `TASKS`: the same items and prompts, per-request loglikelihoods
    within 1e-4 per scored token, the same generations and the same per-item correctness."""
    import numpy as np

    for task in TASKS:
        assert [s["doc_id"] for s in ours[task]] == [s["doc_id"] for s in theirs[task]] == list(range(limit))
        for a, b in zip(ours[task], theirs[task]):
            assert a["prompt_hash"] == b["prompt_hash"]
            if task == "nvfp4tool_gsm":
                assert a["resps"] == b["resps"]  # the generated text, cut at the stop strings
                assert a["exact_match"] == b["exact_match"]
            else:
                mine = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in a["resps"]])
                ref = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in b["resps"]])
                tokens = 1 if task.startswith("nvfp4tool_mc") else len(a["doc"]["page"])  # bytes >= tokens
                np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-4 * tokens)
                for metric in a["metrics"]:
                    if task.startswith("nvfp4tool_mc"):
                        assert a[metric] == b[metric]
