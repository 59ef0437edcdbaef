"""Generation's compiled programs are shared: prompts of four lengths in one bucket, three token
counts and two models of one shape run one prefill and one decode step program; and weights
decoded once give generation the tokens and logits of decoding them at every step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from model.test_model import CONFIGS, batch, random_tensors

from converters.tensor_source import DictTensorSource
from nvfp4tool import memory, progress
from nvfp4tool.export.simulate import DecodedWeight, NVFP4Weight, for_generation, served_linear
from nvfp4tool.model import generate, model_from_tensors
from nvfp4tool.numerics import quantize_nvfp4
from nvfp4tool.numerics.nvfp4 import nvfp4_global_scales

from fixtures.reporters import _Lines


def _module():
    import importlib

    return importlib.import_module("nvfp4tool.model.generate")


def test_bucket_is_the_next_power_of_two():
    gen = _module()
    assert [gen.bucket(n) for n in (1, 16, 17, 32, 33, 100)] == [16, 16, 32, 32, 64, 128]


def test_one_prefill_and_one_step_program_for_lengths_counts_and_models_of_one_shape():
    gen = _module()
    config = CONFIGS["llama3"]
    first, second = (model_from_tensors(config, DictTensorSource(random_tensors(config, seed))) for seed in (0, 1))
    assert nnx.graphdef(first) == nnx.graphdef(second)
    prefill, step = gen._programs(jax.default_backend())
    prefill.clear_cache()
    step.clear_cache()
    rng = np.random.default_rng(0)
    runs = [(first, 5, 4), (first, 11, 4), (second, 7, 3), (second, 16, 2)]  # (model, prompt length, new tokens)
    outputs = [
        np.asarray(generate(model, rng.integers(0, config.vocab_size, (2, length)), count))
        for model, length, count in runs
    ]
    assert prefill._cache_size() == 1 and step._cache_size() == 1
    assert [o.shape for o in outputs] == [(2, 4), (2, 4), (2, 3), (2, 2)]
    assert not np.array_equal(outputs[0], outputs[1])  # different prompts ran, not one cached answer


class _StoredSource(DictTensorSource):
    """A source whose quantized linear weights come as an export stores them (`ExportedModel.get`)."""

    def __init__(self, tensors: dict, stored: dict) -> None:
        super().__init__(tensors)
        self._stored = stored

    def get(self, name: str):
        return self._stored.get(name) or super().get(name)


def _served(config, seed: int = 0):
    """A model held as an NVFP4 export stores it, computing in fp32: the attention's linears W4A4
    (`NVFP4Weight` with a static input scale), the MLP's weight-only, the rest (LM head) BF16."""
    tensors, stored = random_tensors(config, seed, dtype=ml_dtypes.bfloat16), {}
    for name, value in tensors.items():
        if name.endswith("_proj.weight"):
            q = quantize_nvfp4(value.astype(np.float32))
            s_dec = nvfp4_global_scales(q.global_amax)[1]
            input_scale = jnp.float32(3.0 / 2688) if ".self_attn." in name else None
            stored[name] = NVFP4Weight(q.packed, q.scales, s_dec, input_scale)
    return model_from_tensors(
        config, _StoredSource(tensors, stored), dtype=None, compute_dtype=jnp.float32, check=False
    )


def _tokens_and_logits(model, ids, mask):
    logits = []
    tokens = generate(
        model,
        ids,
        5,
        attention_mask=mask,
        linear=served_linear,
        on_token=lambda i, t, scores: logits.append(np.asarray(scores)),
    )
    return np.asarray(tokens), np.stack(logits)


def test_weights_decoded_once_give_the_tokens_and_logits_of_decoding_them_every_step():
    """Stored NVFP4 (W4A4 and weight-only) and BF16 weights, decoded / widened once to fp32."""
    config = CONFIGS["llama3"]
    stored = _served(config)
    decoded = for_generation(stored, "test", budget=1 << 40)
    leaves = jax.tree.leaves(nnx.state(decoded), is_leaf=lambda w: isinstance(w, DecodedWeight | NVFP4Weight))
    assert {w.quant for w in leaves if isinstance(w, DecodedWeight)} == {"nvfp4", "plain"}
    assert not any(isinstance(w, NVFP4Weight) for w in leaves)
    ids, mask = batch()
    tokens, logits = _tokens_and_logits(stored, ids, mask)
    once_tokens, once_logits = _tokens_and_logits(decoded, ids, mask)
    np.testing.assert_array_equal(once_tokens, tokens)
    np.testing.assert_array_equal(once_logits, logits)  # bit for bit, every step
    assert logits.shape == (5, 3, config.vocab_size) and np.ptp(logits) > 1.0  # real logits, not a constant


def test_weights_stay_stored_when_the_decoded_copy_does_not_fit(monkeypatch):
    stored = _served(CONFIGS["llama3"])
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    lines = _Lines()
    previous = progress.use_reporter(lines)
    try:
        assert for_generation(stored, "greedy generation (nvfp4)") is stored
    finally:
        progress.use_reporter(previous)
    assert len(lines.lines) == 1 and lines.lines[0].startswith(
        "greedy generation (nvfp4): weights decoded at every generation step (decoding one once needs "
    )


def test_decoded_copies_stay_within_their_share_of_the_model():
    """By default at most DECODE_ONCE_SHARE of the model's stored bytes are held as decoded fp32
    copies (validate's held memory bound); those decoded give the same tokens and logits."""
    from nvfp4tool.export import simulate

    stored = _served(CONFIGS["llama3"])
    state = nnx.state(stored)
    model_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "nbytes"))
    decoded = for_generation(stored, "test")
    leaves = jax.tree.leaves(nnx.state(decoded), is_leaf=lambda w: isinstance(w, DecodedWeight | NVFP4Weight))
    copies = [w for w in leaves if isinstance(w, DecodedWeight)]
    assert copies and any(isinstance(w, NVFP4Weight) for w in leaves)  # some decoded once, some not
    assert sum(w.data.nbytes for w in copies) <= simulate.DECODE_ONCE_SHARE * model_bytes
    ids, mask = batch()
    np.testing.assert_array_equal(_tokens_and_logits(decoded, ids, mask)[1], _tokens_and_logits(stored, ids, mask)[1])


def test_a_large_model_generates_with_the_optimized_programs_and_the_same_bits_either_way(monkeypatch):
    """At OPTIMIZE_PARAMS parameters and up, generation compiles with XLA's passes on (the level
    follows the config); weights decoded once still give the tokens and logits of decoding them
    at every step, bit for bit."""
    gen = _module()
    config = CONFIGS["llama3"]
    monkeypatch.setattr(gen, "OPTIMIZE_PARAMS", config.num_parameters())  # this tiny model counts as large
    prefill, step = gen._programs(jax.default_backend(), True)
    prefill.clear_cache()
    step.clear_cache()
    stored = _served(config)
    decoded = for_generation(stored, "test", budget=1 << 40)
    ids, mask = batch()
    tokens, logits = _tokens_and_logits(stored, ids, mask)
    once_tokens, once_logits = _tokens_and_logits(decoded, ids, mask)
    assert prefill._cache_size() == 2 and step._cache_size() == 2  # stored and decoded: both optimized
    np.testing.assert_array_equal(once_tokens, tokens)
    np.testing.assert_array_equal(once_logits, logits)
    assert np.ptp(logits) > 1.0
