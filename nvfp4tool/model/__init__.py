"""The Flax NNX Llama-family model: build from HF-named tensors, run, generate.

    model = model_from_tensors(config, HFFolderSource(path))   # or CausalLM(config, rngs=...)
    logits_BxTxV = forward(model, ids_BxT, attention_mask_BxT)
    new_tokens_BxN = generate(model, ids_BxT, 16, attention_mask=mask_BxT)

Every linear layer goes through one pluggable `LinearFn` (see `linear.py`), every attention's keys
and values through one `KVFn` (see `kv.py`); under a transformation that needs what they record
(training's input amax, the router logits), `transformer.forward_side` takes one explicit `Seam`
and returns the side results with the logits.
"""

from nvfp4tool.model.generate import generate
from nvfp4tool.model.kv import KVFn, default_kv
from nvfp4tool.model.linear import LinearFn, default_linear
from nvfp4tool.model.transformer import CausalLM, default_positions, forward
from nvfp4tool.model.weights import ModelTensorSource, model_from_tensors

__all__ = [
    "CausalLM",
    "KVFn",
    "LinearFn",
    "ModelTensorSource",
    "default_kv",
    "default_linear",
    "default_positions",
    "forward",
    "generate",
    "model_from_tensors",
]
