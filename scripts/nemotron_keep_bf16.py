"""The keep-BF16 file of NVIDIA's published NVFP4 Nemotron-3-Nano recipe for any nemotron_h model:
every attention layer and the Mamba layer feeding each stay BF16 (lm_head, the routers and conv1d
are never quantized anyway); export it with the FP8 KV cache, as NVIDIA's checkpoint is:

    python scripts/nemotron_keep_bf16.py HF_FOLDER > keep_bf16.txt
    nvfp4tool export HF_FOLDER --out OUT --keep-bf16-file keep_bf16.txt --kv-cache fp8 --calib-data TEXT
"""

from __future__ import annotations

import argparse

from nvfp4tool.config import ModelConfig
from nvfp4tool.export.plan import format_keep_bf16_file
from nvfp4tool.families.nemotron_h import nvidia_nano_keep_bf16

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a nemotron_h HF folder (or its config.json)")
    config = ModelConfig.from_hf_folder(parser.parse_args().model)
    if config.family != "nemotron_h":
        raise SystemExit(f"{parser.parse_args().model}: a {config.family} model, not nemotron_h")
    print(
        format_keep_bf16_file(
            nvidia_nano_keep_bf16(config),
            comments=[
                "NVIDIA's NVFP4 Nemotron-3-Nano recipe: attention layers and the Mamba layers feeding them in BF16",
                "export with --kv-cache fp8",
            ],
        ),
        end="",
    )
