"""A tiny synthetic HF model and calibration ids for export tests, and `export_options` filling
the calibration settings every such test uses (2 samples of 16 tokens, no progress)."""

from __future__ import annotations

import os
import sys

import numpy as np

from nvfp4tool.config import ModelConfig
from nvfp4tool.export import ExportOptions

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from bench_convert import synthetic_config, write_synthetic_hf_folder

CALIB_SAMPLES, CALIB_SEQ_LEN = 2, 16


def synthetic_source(root, config: ModelConfig, *, seed: int) -> tuple[str, str]:
    """(HF folder of random weights, .npy calibration ids) under `root`."""
    src, calib = os.path.join(root, "hf"), os.path.join(root, "ids.npy")
    write_synthetic_hf_folder(src, config, seed=seed)
    np.save(calib, np.random.default_rng(0).integers(0, config.vocab_size, (CALIB_SAMPLES, CALIB_SEQ_LEN)))
    return src, calib


def export_options(calib: str, **options) -> ExportOptions:
    """ExportOptions calibrated on `calib` as `synthetic_source` made it, plus `options`; without
    `calib` where the export would not use it (W4A16 with RTN and no KV cache: export refuses unused
    --calib-data)."""
    unused = (
        options.get("quant") == "nvfp4-weight-only"
        and options.get("weight_rounding", "rtn") == "rtn"
        and options.get("kv_cache", "none") == "none"
    )
    return ExportOptions(
        calib_data=None if unused else calib,
        calib_samples=CALIB_SAMPLES,
        calib_seq_len=CALIB_SEQ_LEN,
        show_progress=False,
        **options,
    )


def assert_converted_tensors_equal(theirs: dict, ours: dict) -> None:
    """compressed-tensors' ModelOpt converter output (`theirs`, torch tensors) equals our
    compressed-tensors export (`ours`) byte for byte; the converter keeps ModelOpt's scalar shape
    [] where ours is [1] (transformers refuses [])."""
    import torch

    assert sorted(theirs) == sorted(ours)
    for name, tensor in ours.items():
        other = theirs[name]
        assert other.dtype == tensor.dtype, name
        assert other.reshape(-1).view(torch.uint8).equal(tensor.reshape(-1).view(torch.uint8)), name
        assert other.shape == tensor.shape or (other.shape == () and tensor.shape == (1,)), name


def assert_linear_weights_bit_exact(model, ours) -> int:
    """Every nn.Linear-like module of the transformers `model` that `ours` (a `load_export`)
    quantized holds exactly our decoded weight rounded to BF16; returns how many were compared
    (modules without a `weight`, such as fused experts, are not)."""
    import jax.numpy as jnp
    import torch

    checked = 0
    for name, module in model.named_modules():
        if name in ours.quantized and hasattr(module, "weight"):
            mine = np.asarray(jnp.asarray(ours.dequantized(name)).astype(jnp.bfloat16)).view(np.int16)
            assert module.weight.detach().view(torch.int16).numpy().tobytes() == mine.tobytes(), name
            checked += 1
    return checked
