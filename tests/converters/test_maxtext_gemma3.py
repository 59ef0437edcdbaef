"""MaxText <-> HF conversion of Gemma 3 (MaxText's `gemma3` decoder), scanned and unscanned.

The model: the tiny gemma3 fixture with 13 layers in MaxText's fixed pattern (5 sliding : 1 full),
so a scanned checkpoint holds two whole blocks of 6 (stacks of 2 on the layer axis) and one
remainder layer.

* The tree our writer stores restores with plain Orbax to exactly the tree written out here from
  MaxText's own mapping and hooks (utils/param_mapping.py GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING /
  _HOOK_FN, AI-Hypercomputer/maxtext e591f30): the names `decoder/layers/layers_{0..5}/...`
  (stack of layers j, j + 6) and `decoder/layers_remainder/layers_0/...` (layer 12), or
  `decoder/layers_{i}/...`; norms stored as 1 + w, the embedding times bf16(sqrt(hidden)), q/k/v/o
  reshaped per head, no lm_head.
* That fixture tree, saved by a plain CheckpointManager, converts to an HF folder whose transformers
  logits equal the original model's; and `export --model-config` of it equals the HF original's.
* HF -> MaxText -> HF is byte-identical for the bf16 model (fp32 storage). For the fp32 model every
  tensor is byte-identical but the norms, whose 1 + w is rounded to fp32 (the documented loss).
* 4 layers (no whole block: only `layers_remainder`) and 8 (one block, a remainder of 2) round trip
  through the library and read back as scanned.
* The 3-layer fixture (sliding, full, sliding) is refused in one line naming the pattern.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from test_maxtext import _assert_trees_equal, _convert, _torch_logits

from nvfp4tool.cli import cli

from fixtures import hf_fixtures
from fixtures.maxtext_fixture import save_maxtext_checkpoint

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")

LAYERS = 13
OVERRIDES = dict(
    num_hidden_layers=LAYERS,
    layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(LAYERS)],
)
NORMS = (  # MaxText's text_params (the norms), HF name under model.layers.{i}
    ("pre_self_attention_norm-scale", "input_layernorm.weight"),
    ("post_self_attention_norm-scale", "post_attention_layernorm.weight"),
    ("self_attention-query_norm-scale", "self_attn.q_norm.weight"),
    ("self_attention-key_norm-scale", "self_attn.k_norm.weight"),
    ("pre_ffw_norm-scale", "pre_feedforward_layernorm.weight"),
    ("post_ffw_norm-scale", "post_feedforward_layernorm.weight"),
)
KERNELS = (  # (MaxText name, HF name, MaxText's target shape given hidden E, heads N, kv heads K, head_dim D, mlp F)
    ("self_attention-query-kernel", "self_attn.q_proj.weight", lambda E, N, K, D, F: (E, N, D)),
    ("self_attention-key-kernel", "self_attn.k_proj.weight", lambda E, N, K, D, F: (E, K, D)),
    ("self_attention-value-kernel", "self_attn.v_proj.weight", lambda E, N, K, D, F: (E, K, D)),
    ("self_attention-out-kernel", "self_attn.o_proj.weight", lambda E, N, K, D, F: (N, D, E)),
    ("mlp-wi_0-kernel", "mlp.gate_proj.weight", lambda E, N, K, D, F: (E, F)),
    ("mlp-wi_1-kernel", "mlp.up_proj.weight", lambda E, N, K, D, F: (E, F)),
    ("mlp-wo-kernel", "mlp.down_proj.weight", lambda E, N, K, D, F: (F, E)),
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(fp32 folder, bf16 folder, torch fp32 model) of the 13-layer tiny Gemma 3."""
    root = tmp_path_factory.mktemp("hf_gemma3")
    build = hf_fixtures.build_tiny_model
    return (
        build("gemma3", str(root / "fp32"), overrides=OVERRIDES),
        build("gemma3", str(root / "bf16"), dtype="bfloat16", overrides=OVERRIDES),
        hf_fixtures.build_torch_model("gemma3", overrides=OVERRIDES),
    )


def _maxtext_tree(torch_model, *, scanned: bool) -> dict:
    """The params tree MaxText's Gemma 3 mapping and hooks give the model's fp32 state dict,
    written out here (numpy) from those functions as read: "params-a-b" keys -> nested dicts."""
    cfg = torch_model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in torch_model.state_dict().items()}
    E, N, K, D, F = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)[:4] + (
        cfg.intermediate_size,
    )
    normalizer = np.float32(ml_dtypes.bfloat16(E**0.5))  # pad_and_scale_embedding's bf16 normalizer

    def hooked(mx: str, hf: str) -> np.ndarray:
        x = sd[hf]
        if mx.endswith("norm-scale"):  # scale_rmsnorm: MaxText = HF + 1
            return x + np.float32(1.0)
        shape = next(fn for m, _, fn in KERNELS if m == mx)(E, N, K, D, F)
        return x.T.reshape(shape)  # reshape_kernel

    flat = {
        "params-token_embedder-embedding": sd["model.embed_tokens.weight"] * normalizer,
        "params-decoder-decoder_norm-scale": sd["model.norm.weight"] + np.float32(1.0),
    }
    params = NORMS + tuple((mx, hf) for mx, hf, _ in KERNELS)
    if scanned:
        num_scanned = LAYERS - LAYERS % 6
        for block in range(6):
            for mx, hf in params:
                layers = range(block, num_scanned, 6)
                stack = [hooked(mx, f"model.layers.{i}.{hf}") for i in layers]
                flat[f"params-decoder-layers-layers_{block}-{mx}"] = np.stack(stack, axis=1)  # param_scan_axis 1
        for rem in range(LAYERS % 6):
            for mx, hf in params:
                flat[f"params-decoder-layers_remainder-layers_{rem}-{mx}"] = hooked(
                    mx, f"model.layers.{num_scanned + rem}.{hf}"
                )
    else:
        for i in range(LAYERS):
            for mx, hf in params:
                flat[f"params-decoder-layers_{i}-{mx}"] = hooked(mx, f"model.layers.{i}.{hf}")
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split("-")[1:]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = np.ascontiguousarray(value)
    return tree


def _hf_tensors(folder: str) -> dict:
    from converters.hf import HFFolderSource

    source = HFFolderSource(folder)
    return {n: source.get(n) for n in source.names()}


@pytest.mark.parametrize("scanned", [True, False], ids=["scanned", "unscanned"])
def test_the_stored_tree_is_maxtexts_and_the_round_trip_is_exact(gemma, tmp_path, scanned):
    import orbax.checkpoint as ocp

    fp32, bf16, torch_model = gemma
    flag = "--scan-layers" if scanned else "--no-scan-layers"
    _convert(fp32, str(tmp_path / "mt32"), "--to", "maxtext", flag)  # RoPE layout: the family's (half)
    restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(str(tmp_path / "mt32" / "0" / "items"))
    _assert_trees_equal(restored["params"]["params"], _maxtext_tree(torch_model, scanned=scanned))

    _convert(bf16, str(tmp_path / "mt16"), "--to", "maxtext", flag)
    _convert(str(tmp_path / "mt16"), str(tmp_path / "back16"), "--to", "hf", "--model-config", bf16)
    original, back = _hf_tensors(bf16), _hf_tensors(str(tmp_path / "back16"))
    assert back.keys() == original.keys()
    assert all(back[n].dtype == original[n].dtype and back[n].tobytes() == original[n].tobytes() for n in original)

    _convert(str(tmp_path / "mt32"), str(tmp_path / "back32"), "--to", "hf", "--model-config", fp32)
    original, back = _hf_tensors(fp32), _hf_tensors(str(tmp_path / "back32"))
    norms = {n for n in original if n.endswith("norm.weight")}
    assert all(back[n].tobytes() == original[n].tobytes() for n in set(original) - norms)
    for n in norms:  # fp32: 1 + w rounded to fp32, then - 1 (exact): within half an ulp of 1 + w
        assert np.array_equal(back[n], (original[n] + np.float32(1)) - np.float32(1)), n
        assert np.abs(back[n] - original[n]).max() <= 2.0**-24 * np.abs(original[n] + 1).max()


@pytest.mark.parametrize("scanned", [True, False], ids=["scanned", "unscanned"])
def test_maxtexts_checkpoint_converts_and_exports_like_the_original(gemma, tmp_path, scanned):
    fp32, _, torch_model = gemma
    mt = str(tmp_path / "mt")
    save_maxtext_checkpoint(mt, _maxtext_tree(torch_model, scanned=scanned), scanned=scanned)
    _convert(mt, str(tmp_path / "hf"), "--to", "hf", "--model-config", fp32)
    np.testing.assert_allclose(_torch_logits(str(tmp_path / "hf")), _torch_logits(torch_model), rtol=0, atol=1e-4)
    if not scanned:
        return
    from_mt, from_hf = str(tmp_path / "from-mt"), str(tmp_path / "from-hf")
    for src, out, more in ((mt, from_mt, ["--model-config", fp32]), (str(tmp_path / "hf"), from_hf, [])):
        result = CliRunner().invoke(cli, ["export", src, "--out", out, "--quant", "nvfp4-weight-only", *more])
        assert result.exit_code == 0, result.output
    a, b = _hf_tensors_unchecked(from_mt), _hf_tensors_unchecked(from_hf)
    assert a.keys() == b.keys() and all(a[n].tobytes() == b[n].tobytes() for n in a)


def _hf_tensors_unchecked(folder: str) -> dict:
    from converters.hf import HFFolderSource

    source = HFFolderSource(folder, check_config=False)
    return {n: np.ascontiguousarray(source.get(n)) for n in source.names()}


def test_a_pattern_maxtext_cannot_hold_is_refused_in_one_line(hf_tiny_models, tmp_path):
    out = tmp_path / "mt"
    result = CliRunner().invoke(cli, ["convert", hf_tiny_models["gemma3"], str(out), "--to", "maxtext"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: {hf_tiny_models['gemma3']}: gemma3_text layer_types other than 5 sliding : 1 full "
        "(sliding_window_pattern 6) have no MaxText layout: MaxText's gemma3 decoder fixes that pattern"
    ], result.output
    assert not out.exists()


def test_the_named_maxtext_models_are_the_published_text_geometries():
    """gemma3-4b / 12b / 27b (MaxText's configs/models/gemma3-*.yml) read as the Hub's text
    configs but for the vocabulary, MaxText's 262144 (its converter truncates the 262208 rows)."""
    from families.test_gemma3_config import PUBLISHED

    from nvfp4tool.checkpoints import resolve_model_config
    from nvfp4tool.config import ModelConfig

    for label in (4, 12, 27):
        ours, name = resolve_model_config(f"gemma3-{label}b")
        hub = ModelConfig.from_hf_config(dict(PUBLISHED[label], vocab_size=262_144))
        fields = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        assert name == f"gemma3-{label}b"
        assert [getattr(ours, f) for f in fields] == [getattr(hub, f) for f in fields]
        assert ours.family_config == hub.family_config and ours.sliding_window == hub.sliding_window == 1024
        assert ours.tie_word_embeddings and ours.family_spec.maxtext_refusal(ours) is None


@pytest.mark.parametrize("layers", [4, 8])
def test_fewer_than_a_block_or_a_partial_one_round_trips_through_the_library(tmp_path, layers):
    """L < 6: MaxText scans no block, only `layers_remainder` (read back as scanned); L = 8: one
    block (stacks of 1) and a remainder of 2. bf16 values, fp32 storage: exact."""
    from converters.maxtext import MaxTextSource, write_maxtext
    from converters.tensor_source import DictTensorSource
    from nvfp4tool.config import ModelConfig
    from nvfp4tool.families.gemma3 import FULL, SLIDING, Gemma3Fields

    config = ModelConfig(
        family="gemma3_text",
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_layers=layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        qk_norm=True,
        sliding_window=4,
        tie_word_embeddings=True,
        family_config=Gemma3Fields(
            layer_types=tuple(FULL if i % 6 == 5 else SLIDING for i in range(layers)),
            rope=((FULL, 1e6, None), (SLIDING, 1e4, None)),
        ),
    )
    rng = np.random.default_rng(layers)
    tensors = {n: rng.standard_normal(s).astype(ml_dtypes.bfloat16) for n, s in config.expected_tensor_shapes().items()}
    write_maxtext(tmp_path / "mt", config, DictTensorSource(tensors), rope_layout="half", scan_layers=True)
    source = MaxTextSource(tmp_path / "mt", config, "half")
    assert source.scanned and sorted(source.names()) == sorted(tensors)
    assert all(source.get(n).astype(ml_dtypes.bfloat16).tobytes() == tensors[n].tobytes() for n in tensors)
