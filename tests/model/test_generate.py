"""Generation's compiled programs are shared: prompts of four lengths in one bucket, three token
counts and two models of one shape run one prefill and one decode step program; and weights
decoded once give generation the tokens and logits of decoding them at every step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from model.test_model import CONFIGS, batch, random_tensors

from converters.tensor_source import DictTensorSource
from nvfp4tool import memory, progress
from nvfp4tool.errors import NVFP4ToolError
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


def _clear(programs) -> None:
    for program in programs:
        program.clear_cache()


def _compiled(programs) -> dict[str, int]:
    return {name: program._cache_size() for name, program in programs._asdict().items()}


def test_one_layer_program_for_lengths_counts_layers_and_models_of_one_shape():
    """Every decoder layer runs one compiled block program (one for the prefill's shape, one for a
    step's), however many layers: prompts of four lengths in one bucket, three token counts and
    two models of one shape compile each program once; a prompt bucket given up front serves
    prompts of two buckets with the same programs."""
    gen = _module()
    config = CONFIGS["llama3"]
    assert config.num_layers > 1
    first, second = (model_from_tensors(config, DictTensorSource(random_tensors(config, seed))) for seed in (0, 1))
    assert nnx.graphdef(first) == nnx.graphdef(second)
    programs = gen._programs(jax.default_backend())
    _clear(programs)
    rng = np.random.default_rng(0)
    runs = [(first, 5, 4), (first, 11, 4), (second, 7, 3), (second, 16, 2)]  # (model, prompt length, new tokens)
    outputs = [
        np.asarray(generate(model, rng.integers(0, config.vocab_size, (2, length)), count))
        for model, length, count in runs
    ]
    assert _compiled(programs) == {"prefill_in": 1, "prefill_out": 1, "step_in": 1, "step_out": 1, "layer": 2}
    assert [o.shape for o in outputs] == [(2, 4), (2, 4), (2, 3), (2, 2)]
    assert not np.array_equal(outputs[0], outputs[1])  # different prompts ran, not one cached answer
    # prompts of 5 and 20 tokens (buckets 16 and 32) in the bucket of the longest: no new program
    _clear(programs)
    short, long = rng.integers(0, config.vocab_size, (2, 5)), rng.integers(0, config.vocab_size, (2, 20))
    fixed = [np.asarray(generate(first, ids, 4, prompt_bucket=32, cache_len=64)) for ids in (short, long)]
    assert _compiled(programs) == {"prefill_in": 1, "prefill_out": 1, "step_in": 1, "step_out": 1, "layer": 2}
    np.testing.assert_array_equal(fixed[0], np.asarray(generate(first, short, 4)))  # padding changes nothing
    with pytest.raises(NVFP4ToolError, match="cannot hold a prompt of 20 tokens"):
        generate(first, long, 4, prompt_bucket=16)


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
        "greedy generation (nvfp4): weights decoded at every generation step (decoding one linear of every "
        "layer once needs "
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
    layers = [  # every decoder layer decodes the same linears once: one weight layout, one program
        {path for path, w in nnx.to_flat_state(nnx.state(layer)) if isinstance(w.get_value(), DecodedWeight)}
        for layer in decoded.layers
    ]
    assert layers[0] and all(names == layers[0] for names in layers)
    ids, mask = batch()
    np.testing.assert_array_equal(_tokens_and_logits(decoded, ids, mask)[1], _tokens_and_logits(stored, ids, mask)[1])


def test_a_large_model_generates_with_the_optimized_programs_and_the_same_bits_either_way(monkeypatch):
    """At OPTIMIZE_PARAMS parameters and up, generation compiles with XLA's passes on (the level
    follows the config); weights decoded once still give the tokens and logits of decoding them
    at every step, bit for bit."""
    gen = _module()
    config = CONFIGS["llama3"]
    monkeypatch.setattr(gen, "OPTIMIZE_PARAMS", config.num_parameters())  # this tiny model counts as large
    programs = gen._programs(jax.default_backend(), True)
    _clear(programs)
    stored = _served(config)
    decoded = for_generation(stored, "test", budget=1 << 40)
    ids, mask = batch()
    tokens, logits = _tokens_and_logits(stored, ids, mask)
    once_tokens, once_logits = _tokens_and_logits(decoded, ids, mask)
    assert programs.layer._cache_size() == 4  # stored and decoded (prefill, step): both optimized
    np.testing.assert_array_equal(once_tokens, tokens)
    np.testing.assert_array_equal(once_logits, logits)
    assert np.ptp(logits) > 1.0


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def test_weights_decoded_once_in_bf16_are_the_stored_decode_bit_for_bit():
    """Every E2M1 code and E4M3 scale bit pattern (NaN scales included), with global decode scales
    that leave the products normal, push them into fp32 subnormals (flushed to signed zero) or
    round them: the BF16-held block products times S_dec are `decode_nvfp4` bit for bit, whole and
    in row blocks; FP8 values held in BF16 likewise `decode_fp8`."""
    from nvfp4tool.export.simulate import FP8Weight, _decode_once
    from nvfp4tool.numerics import decode_fp8, decode_nvfp4

    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (64, 128), dtype=np.uint8)
    packed[0] = (np.arange(128) * 17 % 256).astype(np.uint8)  # every code in either nibble
    scale_bits = rng.integers(0, 256, (64, 16), dtype=np.uint8)
    scale_bits[1:17] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scales = scale_bits.view(ml_dtypes.float8_e4m3fn)
    for s_dec in (1.0, 3.0 / 2688, 2.0**-118, 2.0**-126 / 3, 1.7e-38, 0.3):
        stored = NVFP4Weight(jnp.asarray(packed), jnp.asarray(scales), jnp.float32(s_dec), None)
        once = _decode_once(stored)
        assert once.data.dtype == jnp.bfloat16 and once.data.nbytes == 2 * 64 * 256
        want = decode_nvfp4(packed, scales, np.float32(s_dec))
        np.testing.assert_array_equal(_bits(once.dequantize()), _bits(want))
        np.testing.assert_array_equal(_bits(jax.jit(lambda w: w.dequantize(8, 40))(once)), _bits(want[8:40]))
        if s_dec == 2.0**-126 / 3:  # products times S_dec below the normal range: flushed to zero
            exact = np.asarray(once.data, np.float64) * np.float32(s_dec)
            subnormal = (exact != 0) & (np.abs(exact) < 2.0**-126)
            assert subnormal.sum() > 100 and np.all(np.asarray(want)[subnormal] == 0)
    data = np.arange(256, dtype=np.uint8).reshape(16, 16).view(ml_dtypes.float8_e4m3fn)
    for scale in (1.0 / 448, 2.0**-120, 0.7):
        once = _decode_once(FP8Weight(jnp.asarray(data), jnp.float32(scale), None))
        assert once.data.dtype == jnp.bfloat16 and once.quant == "fp8"
        np.testing.assert_array_equal(_bits(once.dequantize()), _bits(decode_fp8(data, np.float32(scale))))
