"""An independent MaxText checkpoint builder for tests (does not import `converters`).

From a transformers model's state dict (torch tensors) it builds the MaxText parameter tree straight
from the reference sheet's layout table (section 6) with its own transpose / reshape / RoPE / scale
code -- for a mixture of experts from transformers' in-memory fused experts (`mlp.experts.gate_up_proj
[X, 2F, E]`, gate rows first, and `down_proj [X, E, F]`; not the per-expert names of the files) into
MaxText's RoutedMoE arrays as MaxText's conversion scripts lay them out (router `<block>/gate/kernel
[E, X]`, experts `<block>/wi_0`, `wi_1 [X, E, F]`, `wo [X, F, E]`; scanned: layers on axis 1 after the
experts), wraps it in a TrainState-like dict `{step, params: {params: ...}, opt_state: ...}` (a fake
Adam state, so a reader that loaded it would be caught), and saves it with a plain Orbax
`CheckpointManager` using Orbax's default handler options (OCDBT, and whatever zarr version the
installed Orbax defaults to), scanned or unscanned.
"""

from __future__ import annotations

import math
import os

import numpy as np


def maxtext_params_from_state_dict(
    state_dict,
    *,
    num_layers: int,
    head_dim: int,
    scanned: bool,
    interleaved: bool,
    tied: bool,
    moe_block: str | None = None,
    scale_query: bool = True,
) -> dict:
    """MaxText `params` collection (nested dict of fp32 numpy arrays) from an HF state dict.

    moe_block: the MaxText name of a sparse layer's RoutedMoE ("MoeBlock_0" Mixtral, "moe_block"
    Qwen3-MoE; every layer sparse), None for a dense model. scale_query: whether the query kernel
    carries 1/sqrt(head_dim) (not for Qwen3-MoE, whose attention scales itself). q/k norms are
    stored when the state dict has them."""
    import torch

    def np32(t: "torch.Tensor") -> np.ndarray:
        return t.detach().to(torch.float32).cpu().numpy()

    def heads_in(w: "torch.Tensor", rope: bool, scale: bool) -> np.ndarray:
        rows, emb = w.shape
        per_head = w.to(torch.float32).reshape(rows // head_dim, head_dim, emb)  # [N, D, E]
        if rope and interleaved:  # row j of the interleaved head is half-split row perm[j]
            perm = [j // 2 + (j % 2) * (head_dim // 2) for j in range(head_dim)]
            per_head = per_head[:, perm, :]
        if scale and scale_query:
            per_head = per_head * torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32)
        return np32(per_head.permute(2, 0, 1))  # [E, N, D]

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        o = state_dict[p + "self_attn.o_proj.weight"]  # [E, H*D]
        params = {
            "pre_self_attention_layer_norm": {"scale": np32(state_dict[p + "input_layernorm.weight"])},
            "post_self_attention_layer_norm": {"scale": np32(state_dict[p + "post_attention_layernorm.weight"])},
            "self_attention": {
                "query": {"kernel": heads_in(state_dict[p + "self_attn.q_proj.weight"], True, True)},
                "key": {"kernel": heads_in(state_dict[p + "self_attn.k_proj.weight"], True, False)},
                "value": {"kernel": heads_in(state_dict[p + "self_attn.v_proj.weight"], False, False)},
                "out": {"kernel": np32(o.reshape(o.shape[0], -1, head_dim).permute(1, 2, 0))},  # [H, D, E]
            },
        }
        if p + "self_attn.q_norm.weight" in state_dict:
            attention = params["self_attention"]
            attention["query_norm"] = {"scale": np32(state_dict[p + "self_attn.q_norm.weight"])}
            attention["key_norm"] = {"scale": np32(state_dict[p + "self_attn.k_norm.weight"])}
        if moe_block is None:
            params["mlp"] = {
                "wi_0": {"kernel": np32(state_dict[p + "mlp.gate_proj.weight"].t())},
                "wi_1": {"kernel": np32(state_dict[p + "mlp.up_proj.weight"].t())},
                "wo": {"kernel": np32(state_dict[p + "mlp.down_proj.weight"].t())},
            }
        else:
            gate_up = state_dict[p + "mlp.experts.gate_up_proj"]  # [X, 2F, E]: gate rows, then up rows
            F = gate_up.shape[1] // 2
            params[moe_block] = {
                "gate": {"kernel": np32(state_dict[p + "mlp.gate.weight"].t())},  # [E, X]
                "wi_0": np32(gate_up[:, :F].permute(0, 2, 1)),  # [X, E, F]
                "wi_1": np32(gate_up[:, F:].permute(0, 2, 1)),
                "wo": np32(state_dict[p + "mlp.experts.down_proj"].permute(0, 2, 1)),  # [X, F, E]
            }
        return params

    decoder: dict = {"decoder_norm": {"scale": np32(state_dict["model.norm.weight"])}}
    if not tied:
        decoder["logits_dense"] = {"kernel": np32(state_dict["lm_head.weight"].t())}
    layers = [layer(i) for i in range(num_layers)]
    if scanned:
        decoder["layers"] = _stack_on_axis_1(layers)
    else:
        decoder.update({f"layers_{i}": layers[i] for i in range(num_layers)})
    return {"token_embedder": {"embedding": np32(state_dict["model.embed_tokens.weight"])}, "decoder": decoder}


def save_maxtext_checkpoint(base_dir: str, params: dict, *, scanned: bool, step: int = 0) -> str:
    """Save `{step, params: {params}, opt_state}` with an Orbax CheckpointManager; return the
    `<base>/<step>/items` path."""
    import orbax.checkpoint as ocp

    fake_adam = {
        "count": np.int32(step),
        "mu": _map(params, np.ones_like),
        "nu": _map(params, lambda a: np.full_like(a, 7.0)),
    }
    state = {"step": np.int32(step), "params": {"params": params}, "opt_state": fake_adam}
    manager = ocp.CheckpointManager(
        os.path.abspath(base_dir), item_names=("items",), options=ocp.CheckpointManagerOptions(create=True)
    )
    manager.save(
        step, args=ocp.args.Composite(items=ocp.args.PyTreeSave(state)), custom_metadata={"scan_layers": scanned}
    )
    manager.wait_until_finished()
    manager.close()
    return os.path.join(os.path.abspath(base_dir), str(step), "items")


def _stack_on_axis_1(layers: list[dict]) -> dict:
    first = layers[0]
    if isinstance(first, dict):
        return {k: _stack_on_axis_1([layer[k] for layer in layers]) for k in first}
    return np.stack(layers, axis=1)


def _map(tree, fn):
    return {k: _map(v, fn) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def record_array_opens(monkeypatch) -> list[str]:
    """The paths of the arrays a reader opens for data from now on (tensorstore.open with a dict
    spec; Orbax's own metadata opens pass a ts.Spec and are not counted)."""
    import tensorstore

    opened: list[str] = []
    real_open = tensorstore.open

    def spy_open(spec, *args, **kwargs):
        if isinstance(spec, dict):
            opened.append(spec["kvstore"]["path"])
        return real_open(spec, *args, **kwargs)

    monkeypatch.setattr(tensorstore, "open", spy_open)
    return opened
