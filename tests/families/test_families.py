"""The module table of every family (`nvfp4tool.families`) against transformers' own model:
every linear present with its shape, its layer kind, its fused group and its tensor-parallel split.

Independent sources: `named_modules()` of the tiny PyTorch models (nn.Linear modules, the MoE
routers, and the experts' fused `gate_up_proj` [E, 2F, H] / `down_proj` [E, H, F] parameters of
transformers 5), the class of each layer's MLP (sparse or dense), forward hooks (the members of a
fused group read the same input) and the config's `base_model_tp_plan` (colwise / rowwise;
transformers >= 5.25 lists the experts in its `base_model_ep_plan` instead).
Mixtral's checkpoint names its sparse block `block_sparse_moe`, which transformers 5 renames to
`mlp` in memory (`WeightRenaming(".block_sparse_moe.", ".mlp.")`); the table keeps checkpoint names.
"""

from __future__ import annotations

import fnmatch
import json

import pytest

from nvfp4tool.config import ModelConfig
from nvfp4tool.families import (
    ATTENTION_MLP,
    ATTENTION_MOE,
    REGISTRY,
    fused_group,
    get_family,
    hessian_group,
    projection_of,
)

from fixtures.hf_fixtures import FAMILY_KEYS, build_torch_model

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")

_SPLIT = {"colwise": "column", "packed_colwise": "column", "rowwise": "row"}


def _tables(key: str):
    model = build_torch_model(key)
    config = ModelConfig.from_hf_config(json.loads(model.config.to_json_string()))
    return model, config, config.modules


def _memory_name(config: ModelConfig, name: str) -> str:
    """The table's (checkpoint) name as transformers 5 names the module in memory."""
    return f"{name}.".replace(".block_sparse_moe.", ".mlp.")[:-1] if config.family == "mixtral" else name


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_every_linear_and_expert_of_the_transformers_model_is_in_the_table(key):
    model, config, table = _tables(key)
    modules = dict(model.named_modules())
    hf_linears = {
        n: tuple(m.weight.shape)
        for n, m in modules.items()
        if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("TopKRouter")
    }
    if config.tie_word_embeddings:  # tied: transformers still has the lm_head module, sharing the table
        assert modules["lm_head"].weight is model.model.embed_tokens.weight
    ours = {_memory_name(config, m.name): m.shape for m in table.linears if m.expert is None}
    assert ours == hf_linears
    experts = {n: m for n, m in modules.items() if hasattr(m, "gate_up_proj")}
    assert {f"{_memory_name(config, r)[: -len('.gate')]}.experts" for r in table.routers()} == set(experts)
    for name, hf in experts.items():
        E, two_F, H = hf.gate_up_proj.shape
        rows = [m for m in table.linears if m.expert is not None and _memory_name(config, m.block) + ".experts" == name]
        assert sorted({m.expert for m in rows}) == list(range(E)) and len(rows) == 3 * E
        shapes = {m.role: m.shape for m in rows}
        assert shapes == {"gate": (two_F // 2, H), "up": (two_F // 2, H), "down": tuple(hf.down_proj.shape[1:])}
        for e in range(E):  # gate and up of one expert are one tensor in transformers: one fused group
            gate, up = (m for m in rows if m.expert == e and m.role in ("gate", "up"))
            assert gate.group == up.group != gate.name


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_layer_kinds_are_the_mlp_classes_of_transformers(key):
    model, config, table = _tables(key)
    for i, layer in enumerate(model.model.layers):
        sparse = "Sparse" in type(layer.mlp).__name__
        assert config.layer_kind(i) == (ATTENTION_MOE if sparse else ATTENTION_MLP)
        assert {m.kind for m in table.linears if m.layer == i} == {config.layer_kind(i)}
    assert table.attentions == tuple(f"model.layers.{i}.self_attn" for i in range(config.num_layers))


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_tensor_parallel_splits_are_transformers_tp_plan(key):
    model, config, table = _tables(key)
    plan = model.config.base_model_tp_plan
    for m in table.linears:
        if m.router or m.layer is None:
            assert m.split == "none"
            continue
        hf = _memory_name(config, m.name).removeprefix("model.")
        if m.expert is not None:  # the plan names the fused expert tensors
            hf = f"{hf.rpartition('.experts.')[0]}.experts.{'down_proj' if m.role == 'down' else 'gate_up_proj'}"
        style = next((v for p, v in plan.items() if fnmatch.fnmatchcase(hf, p)), None)
        if style is None and m.expert is not None:
            # transformers >= 5.25 parallelizes experts by expert (its EP plan), not by splitting them
            assert any(fnmatch.fnmatchcase(hf, p) for p in model.config.base_model_ep_plan), hf
            continue
        assert style is not None, f"{hf}: not in transformers' TP plan"
        assert m.split == _SPLIT[style], (m.name, style)


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_fused_groups_read_one_input_in_transformers(key):
    """Members of a fused group (q/k/v, gate/up) are called on the very same input tensor."""
    model, config, table = _tables(key)
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_hook(lambda mod, args, out, n=name: seen.__setitem__(n, args[0]))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    with torch.no_grad():
        model(input_ids=torch.arange(3, 11)[None])
    for h in hooks:
        h.remove()
    groups = {g: ms for g, ms in table.groups().items() if len(ms) > 1 and table[ms[0]].expert is None}
    assert groups, "every family has a fused q/k/v"
    for group, members in groups.items():
        inputs = [seen[_memory_name(config, m)] for m in members]
        assert all(x is inputs[0] for x in inputs), group
    lone = [m.name for m in table.linears if m.group == m.name and m.expert is None and m.layer is not None]
    assert all(table[n].role in ("o", "down", "router") for n in lone)


def test_names_alone_give_the_table_facts():
    """`fused_group` / `projection_of` on a bare name (check's folders without a parseable config)
    agree with the table of every family."""
    for key in FAMILY_KEYS:
        _, _, table = _tables(key)
        for m in table.linears:
            assert fused_group(m.name) == m.group
            if m.layer is not None:
                assert projection_of(m.name).split == m.split
    gate, up = "model.layers.0.mlp.experts.5.gate_proj", "model.layers.0.mlp.experts.2.up_proj"
    assert hessian_group(gate) == hessian_group(up) == "model.layers.0.mlp.experts.gate_up"
    assert hessian_group("model.layers.0.self_attn.v_proj") == "model.layers.0.self_attn.qkv"


def test_registry_refuses_an_unknown_family_naming_the_supported():
    with pytest.raises(Exception, match="unsupported model family 'gpt2'; supported: llama, mistral"):
        get_family("gpt2")
    assert all(REGISTRY[t].model_type == t for t in REGISTRY)


def test_a_layer_kind_without_a_block_is_refused_in_one_line(monkeypatch):
    """The model builds each layer from the block its family registers for the layer's kind
    (`model.blocks`); a kind a family declares but registers no block for is named, with the
    family's kinds that have blocks, not a KeyError."""
    from nvfp4tool.errors import NVFP4ToolError
    from nvfp4tool.model import CausalLM

    _, config, _ = _tables("llama3")
    monkeypatch.setattr(type(config.family_spec), "layer_kind", lambda self, config, layer: "retention")
    with pytest.raises(
        NVFP4ToolError,
        match=r"llama: layer kind 'retention' has no block in the model \(kinds with blocks: attention\+mlp\)$",
    ):
        CausalLM(config)
