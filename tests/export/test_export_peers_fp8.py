"""Our compressed-tensors FP8 export (`float-quantized`, per tensor) against transformers +
compressed-tensors (marker: peers): the peer test of that layout's spec.

transformers (CPU) loads the export (its parameters, weight_scale included, in the model dtype
BF16) and decompresses every FP8 weight to BF16: those must equal fp32(e4m3) * fp32(bf16(scale))
rounded to BF16, bit for bit, for every quantized linear, where the e4m3 codes and scale are
read through the layout's spec; and the model's logits must be finite.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from nvfp4tool import formats
from nvfp4tool.check import check_checkpoint
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.export.simulate import load_export

from fixtures.export_fixtures import assert_fp8_weights_bit_exact
from fixtures.hf_fixtures import build_tiny_model

pytestmark = pytest.mark.peers


def test_transformers_loads_our_compressed_tensors_fp8_export_bit_exact(tmp_path):
    import torch
    import transformers

    src = build_tiny_model("llama3", str(tmp_path / "hf"))
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).integers(0, 256, (4, 16)))
    folder = str(tmp_path / "ct-fp8")
    export_checkpoint(
        src,
        folder,
        ExportOptions(
            format="compressed-tensors",
            quant="fp8",
            calib_data=str(tmp_path / "calib.npy"),
            calib_samples=4,
            calib_seq_len=16,
            show_progress=False,
        ),
    )
    assert formats.describe(folder).spec is formats.get("compressed-tensors", "fp8")
    assert check_checkpoint(folder).ok
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = np.random.default_rng(1).integers(3, 256, (2, 12))
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits
    assert torch.isfinite(logits).all()
    ours = load_export(folder)
    checked = assert_fp8_weights_bit_exact(model, folder, ours)
    assert checked == len(ours.quantized) == 14
    assert os.path.isfile(os.path.join(folder, "config.json"))
