"""Tiny synthetic exports for the validate tests: a BF16 source with one outlier weight, its NVFP4
(W4A4) and FP8 exports, and a copy of the NVFP4 export with one block scale multiplied by 16."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np

from converters.hf import SINGLE_FILE, read_safetensors_header, write_safetensors
from nvfp4tool.export import ExportOptions, export_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_convert import synthetic_config

CONFIG = synthetic_config(hidden=64, mlp=128, layers=2, vocab=256, head_dim=16, kv_heads=2, dtype="bfloat16")
BROKEN_MODULE = "model.layers.1.mlp.down_proj"
SEQ_LEN = 32


def build_exports(root: str) -> dict[str, str]:
    """{"src", "nvfp4", "fp8", "broken", "ids"} paths under `root`."""
    paths = {k: os.path.join(root, k) for k in ("src", "nvfp4", "fp8", "broken")}
    paths["ids"] = os.path.join(root, "ids.npy")
    np.save(paths["ids"], np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, SEQ_LEN)))
    _write_source(paths["src"])
    for quant in ("nvfp4", "fp8"):
        export_checkpoint(
            paths["src"],
            paths[quant],
            ExportOptions(quant=quant, calib_data=paths["ids"], calib_seq_len=SEQ_LEN, show_progress=False),
        )
    shutil.copytree(paths["nvfp4"], paths["broken"])
    break_block_scale(paths["broken"], BROKEN_MODULE, factor_log2=4)
    rerecord(paths["broken"], BROKEN_MODULE)
    return paths


def rerecord(folder: str, module: str) -> None:
    """Update the export record for `module`'s tensors as if the export itself had written the bytes
    now in the file: a consistent (check-clean) export with one badly quantized layer, which only
    validate's numbers can catch."""
    import dataclasses
    import hashlib

    from nvfp4tool import formats
    from nvfp4tool.check.record import decoded_amax
    from nvfp4tool.records.export import ExportRecord

    record, spec = ExportRecord.read(folder), formats.describe(folder).spec
    entries = read_safetensors_header(os.path.join(folder, SINGLE_FILE))
    tensors = dict(record.tensors)
    for name in [n for n in tensors if n.rpartition(".")[0] == module]:
        entry = entries[name]
        with open(entry.file, "rb") as f:
            f.seek(entry.start)
            digest = hashlib.sha256(f.read(entry.nbytes)).hexdigest()
        amax = decoded_amax(module, entries, spec) if tensors[name].amax is not None else None
        tensors[name] = dataclasses.replace(tensors[name], sha256=digest, amax=amax)
    dataclasses.replace(record, tensors=tensors).write(folder)


def break_block_scale(folder: str, module: str, factor_log2: int) -> int:
    """Multiply the largest E4M3 block scale of `module` that stays finite by 2**factor_log2, in
    place in the file (exponent field + factor_log2). Returns the flat index of the block."""
    file = os.path.join(folder, SINGLE_FILE)
    entry = read_safetensors_header(file)[f"{module}.weight_scale"]
    with open(file, "r+b") as f:
        f.seek(entry.start)
        raw = np.frombuffer(f.read(entry.nbytes), np.uint8).copy()
        exponent = (raw >> 3) & 0xF
        room = (exponent >= 1) & (exponent + factor_log2 <= 15) & ((raw & 0x7F) + (factor_log2 << 3) < 0x7F)
        if not room.any():
            raise ValueError(f"{module}: no block scale can grow by 2**{factor_log2}")
        index = int(np.flatnonzero(room)[np.argmax((raw & 0x7F)[room])])
        raw[index] += factor_log2 << 3
        f.seek(entry.start + index)
        f.write(bytes([int(raw[index])]))
    return index


def _write_source(folder: str) -> None:
    """Random N(0, 0.02) BF16 weights; BROKEN_MODULE gets one 100-sigma outlier, as real LLM layers
    have, so that its other block scales are small enough to be multiplied by 16 in E4M3."""
    import json

    os.makedirs(folder)
    shapes = CONFIG.expected_tensor_shapes()
    rng = np.random.default_rng(3)

    def make(name: str) -> np.ndarray:
        w = 0.02 * rng.standard_normal(shapes[name], dtype=np.float32)
        if name.endswith("norm.weight"):
            w = 1.0 + w
        if name == f"{BROKEN_MODULE}.weight":
            w[0, 0] = 2.0
        return w.astype(CONFIG.dtype)

    write_safetensors(os.path.join(folder, SINGLE_FILE), [(n, CONFIG.dtype, s) for n, s in shapes.items()], make)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG.to_hf_config(), f, indent=2)


def validation_record(passed: bool = True):
    """A small, complete ValidationRecord (for tests of what reads validation.json: push, the card)."""
    from nvfp4tool.records.validation import DataRef, Failure, Generation, Histogram, LayerSQNR, Named, ValidationRecord

    failures = [] if passed else [Failure(metric="kl_mean", value=0.2, limit=0.05, by=0.15, detail="nvfp4 vs bf16")]
    return ValidationRecord(
        export=Named("llama-nvfp4", {"model.safetensors": "0" * 64}),
        quant="nvfp4",
        format="compressed-tensors",
        source=Named("meta-llama/Llama-3.2-1B", {"model.safetensors": "1" * 64}),
        source_kind="hf",
        source_step=None,
        reference="bf16",
        reference_export=None,
        data=DataRef(file=Named("val.txt", {"val.txt": "2" * 64}), sequences=2, seq_len=8, tokens=16),
        models={"bf16": {"ppl": 9.5}, "nvfp4": {"kl_mean": 0.0123, "top1": 0.97}},
        layers=[LayerSQNR("model.layers.0.mlp.up_proj", {"nvfp4": 20.5}, {"nvfp4": 19.0})],
        generation=Generation(prompts=2, prompt_len=4, tokens=8, first_divergence={"nvfp4": [None, 5]}),
        kl_histogram={"nvfp4": Histogram(edges=[1e-8, 1.0], counts=[16])},
        thresholds={"max_kl_mean": 0.05},
        failures=failures,
        passed=passed,
    )
