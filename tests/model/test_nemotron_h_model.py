"""The registered nemotron_h family end to end through the model: an HF folder written by
transformers 5.24's `NemotronHForCausalLM` (checkpoint names `backbone.*`) read by our reader and
run by our Flax model equals transformers' logits (fp32, teacher forced, a left-padded row beside
a full one) on tiny fixtures with every layer kind: dense (M * -) and MoE (E, with a latent size,
grouped routing and the shared expert), chunk boundaries inside and at the sequence end, lengths
not a multiple of chunk_size. Our writer writes the checkpoint's names back, so transformers loads
what we write; config.json round-trips in the source's own spelling.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from converters.hf import HFFolderSource, write_hf_folder
from nvfp4tool.config import ModelConfig
from nvfp4tool.model import forward, model_from_tensors
from nvfp4tool.model.weights import ModelTensorSource

from fixtures.hybrid_fixtures import DENSE, MOE, _hf_folder

torch = pytest.importorskip("torch")


def _batch(t: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(t).integers(3, vocab, (2, t))
    mask = np.ones((2, t), np.int64)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("options, t", [(DENSE, 11), (DENSE, 8), (MOE, 9)], ids=["dense-11", "dense-8", "moe-9"])
def test_logits_equal_transformers(tmp_path, options, t):
    folder, reference = _hf_folder(tmp_path, options, seed=t)
    config = ModelConfig.from_hf_folder(folder)
    assert config.family == "nemotron_h"
    model = model_from_tensors(config, HFFolderSource(folder))
    ids, mask = _batch(t, options["vocab_size"])
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(want[real]).max() > 0.5  # the fixture's logits are not trivially small
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)


def test_written_folder_loads_in_transformers_with_the_checkpoint_names(tmp_path):
    from transformers import NemotronHForCausalLM

    folder, reference = _hf_folder(tmp_path, MOE, seed=3)
    config = ModelConfig.from_hf_folder(folder)
    model = model_from_tensors(config, HFFolderSource(folder))
    out = tmp_path / "ours"
    write_hf_folder(out, config, ModelTensorSource(model), dtype="fp32")
    from safetensors import safe_open

    def names(folder) -> set[str]:
        with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
            return set(f.keys())

    written_names = names(out)
    assert written_names == names(tmp_path / "hf")  # transformers' save: per expert, the checkpoint's names
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight"} <= written_names
    written = json.loads((out / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("layers_block_type", "time_step_limit", "layer_norm_epsilon", "n_routed_experts", "moe_latent_size"):
        assert written[key] == source[key], key
    assert "rope_theta" not in written and "hidden_act" not in written
    again = NemotronHForCausalLM.from_pretrained(out).float().eval()
    ids, mask = _batch(7, MOE["vocab_size"])
    with torch.no_grad():
        a = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
        b = again(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    assert torch.equal(a, b)


def test_module_table_of_a_hybrid():
    hf = {"model_type": "nemotron_h", **MOE}
    config = ModelConfig.from_hf_config(hf)
    table = config.modules
    kinds = [config.layer_kind(i) for i in range(config.num_layers)]
    assert kinds == ["mamba", "moe", "attention", "moe", "mamba", "mlp"]
    assert table["model.layers.0.mixer.in_proj"].split == "column"
    assert table["model.layers.0.mixer.out_proj"].split == "row"
    assert table.routers() == ["model.layers.1.mixer.gate", "model.layers.3.mixer.gate"]
    assert table.kept() == {"model.layers.1.mixer.gate", "model.layers.3.mixer.gate", "lm_head"}
    assert table.attentions == ("model.layers.2.mixer",)
    assert table["model.layers.2.mixer.k_proj"].group == "model.layers.2.mixer.qkv"
    assert table["model.layers.1.mixer.experts.5.up_proj"].expert == 5
    shapes = config.expected_tensor_shapes()
    assert shapes["model.layers.0.mixer.conv1d.weight"] == (4 * 8 + 2 * 2 * 6, 1, 4)
    assert shapes["model.layers.0.mixer.in_proj.weight"] == (2 * 32 + 2 * 2 * 6 + 4, 32)
    assert shapes["model.layers.1.mixer.fc1_latent_proj.weight"] == (16, 32)
    assert shapes["model.layers.1.mixer.experts.0.up_proj.weight"] == (16, 16)


def test_what_the_family_lacks_is_refused_in_one_line(tmp_path):
    """convert --to maxtext says MaxText has no Mamba-2 decoder (before asking for a RoPE layout);
    export --equalize says equivalent scaling is not built for the hybrid; nothing is written."""
    from click.testing import CliRunner

    from nvfp4tool.cli import cli

    folder, _ = _hf_folder(tmp_path, DENSE, seed=1)
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).integers(3, 40, (4, 16)))
    cases = [
        (["convert", folder, str(tmp_path / "mt"), "--to", "maxtext"], "MaxText has no Mamba-2 decoder"),
        (
            [
                "export",
                folder,
                "--out",
                str(tmp_path / "e"),
                "--equalize",
                "awq",
                "--calib-data",
                str(tmp_path / "calib.npy"),
                "--calib-samples",
                "4",
                "--calib-seq-len",
                "16",
            ],
            "equivalent scaling (--equalize) is not built for the hybrid family",
        ),
    ]
    for args, says in cases:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1, (args, result.output)
        errors = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and says in errors[0], result.output
    assert not (tmp_path / "e").exists() and not (tmp_path / "mt").exists()


def test_multi_token_prediction_tensors_are_refused_naming_them(tmp_path):
    """A checkpoint with `mtp.*` layers (Nemotron 3's multi-token prediction, which vLLM drops and
    transformers 5.24 does not build) is refused in one line naming the tensor: the model has no
    such layer, so carrying them would publish weights nothing checked."""
    from safetensors.numpy import load_file, save_file

    from nvfp4tool.errors import NVFP4ToolError

    folder, _ = _hf_folder(tmp_path, DENSE, seed=1)
    tensors = load_file(f"{folder}/model.safetensors")
    tensors["mtp.layers.0.norm.weight"] = np.ones(32, np.float32)
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NVFP4ToolError, match=r"mtp\.layers\.0\.norm\.weight"):
        HFFolderSource(folder)


@pytest.mark.parametrize("options", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_cached_generation_equals_recomputation_and_transformers(tmp_path, options):
    """Greedy decoding with the per-kind decode state (attention KV cache, Mamba conv window and SSM
    state) picks the tokens full-sequence recomputation picks, a left-padded row included, and the
    tokens transformers' own cached generate picks."""
    from nvfp4tool.model import generate

    folder, reference = _hf_folder(tmp_path, options, seed=11)
    config = ModelConfig.from_hf_folder(folder)
    model = model_from_tensors(config, HFFolderSource(folder))
    ids, mask = _batch(6, options["vocab_size"])
    new = np.asarray(generate(model, jnp.asarray(ids), 7, attention_mask=jnp.asarray(mask)))
    seq, seq_mask = ids.copy(), mask.copy()
    for step in range(7):
        logits = np.asarray(forward(model, jnp.asarray(seq), jnp.asarray(seq_mask)))
        token = logits[:, -1].argmax(-1)
        assert (token == new[:, step]).all(), step
        seq = np.concatenate([seq, token[:, None]], axis=1)
        seq_mask = np.concatenate([seq_mask, np.ones((2, 1), np.int64)], axis=1)
    with torch.no_grad():
        want = reference.generate(
            torch.from_numpy(ids[:1]),
            attention_mask=torch.from_numpy(mask[:1]),
            max_new_tokens=7,
            do_sample=False,
            eos_token_id=None,
        ).numpy()[:, 6:]
    np.testing.assert_array_equal(new[:1], want)


def test_a_right_padded_prompt_is_refused_for_a_recurrent_model(tmp_path):
    from nvfp4tool.errors import NVFP4ToolError
    from nvfp4tool.model import generate

    folder, _ = _hf_folder(tmp_path, DENSE, seed=2)
    model = model_from_tensors(ModelConfig.from_hf_folder(folder), HFFolderSource(folder))
    mask = np.ones((1, 5), np.int64)
    mask[0, -2:] = 0
    with pytest.raises(NVFP4ToolError, match="needs left-padded prompts"):
        generate(model, jnp.ones((1, 5), jnp.int32), 2, attention_mask=jnp.asarray(mask))


def test_scanned_runs_of_equal_kinds_equal_transformers(tmp_path):
    """Runs of equal kinds (MM, **, --, EE) scanned as one program each: the same logits, and the
    same cached generation (the run's decode states stacked and given back per layer)."""
    from nvfp4tool.model import generate

    options = dict(MOE, hybrid_override_pattern="MM**--EE")
    folder, reference = _hf_folder(tmp_path, options, seed=5)
    config = ModelConfig.from_hf_folder(folder)
    scanned = model_from_tensors(config, HFFolderSource(folder), scan_layers=True)
    plain = model_from_tensors(config, HFFolderSource(folder))
    ids, mask = _batch(9, options["vocab_size"])
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    got = np.asarray(forward(scanned, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(
        np.asarray(generate(scanned, jnp.asarray(ids), 4, attention_mask=jnp.asarray(mask))),
        np.asarray(generate(plain, jnp.asarray(ids), 4, attention_mask=jnp.asarray(mask))),
    )
