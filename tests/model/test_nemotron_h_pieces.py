"""The pieces of the hybrid Nemotron-H family, against transformers 5.24 in fp32.

model/mamba.py: the chunked SSD scan against a float64 numpy recurrence and the step-by-step
recurrence; the mixer (in_proj and out_proj as plain GEMMs around it) against
`NemotronHMamba2Mixer`'s PyTorch path, left padding included; decode from a prefill's state equal
to recomputation; the Flax `Mamba2Mixer` on the linear seam with transformers' parameters.
model/transformer.py's `route_grouped_sigmoid` against `NemotronHTopkRouter`; model/hybrid.py's
relu2 MLP and MoE mixer (latent, shared expert, grouped routing) and `RMSNorm(scale_in_fp32=True)`
against NemotronHMLP, NemotronHMoE and NemotronHRMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.model import mamba


def _oracle(x, dt, a, b, c, h0):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t, float64, one position at a time."""
    x, dt, a, b, c, h = (np.asarray(v, np.float64) for v in (x, dt, a, b, c, h0))
    rep = x.shape[2] // b.shape[2]
    b, c = np.repeat(b, rep, axis=2), np.repeat(c, rep, axis=2)
    ys = []
    for t in range(x.shape[1]):
        h = np.exp(dt[:, t] * a)[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append(np.einsum("bhpn,bhn->bhp", h, c[:, t]))
    return np.stack(ys, axis=1), h


def _scan_inputs(rng, bsz, t, h=4, p=3, g=2, n=5):
    x = rng.standard_normal((bsz, t, h, p)).astype(np.float32)
    dt = np.log1p(np.exp(rng.standard_normal((bsz, t, h)))).astype(np.float32)  # softplus: > 0
    a = -np.exp(rng.standard_normal(h)).astype(np.float32)
    b = rng.standard_normal((bsz, t, g, n)).astype(np.float32)
    c = rng.standard_normal((bsz, t, g, n)).astype(np.float32)
    h0 = rng.standard_normal((bsz, h, p, n)).astype(np.float32)
    return x, dt, a, b, c, h0


@pytest.mark.parametrize("t, chunk", [(1, 4), (4, 4), (5, 4), (13, 4), (16, 4), (7, 16)])
def test_chunked_scan_equals_the_recurrence(t, chunk):
    """Chunk boundaries inside the sequence and at its end, lengths not a multiple of the chunk, a
    sequence shorter than one chunk, a nonzero initial state."""
    inputs = _scan_inputs(np.random.default_rng(t * 31 + chunk), 2, t)
    want_y, want_h = _oracle(*inputs)
    x, dt, a, b, c, h0 = map(jnp.asarray, inputs)
    y, h = mamba.ssd_chunked(x, dt, a, b, c, chunk, h0)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=2e-5, atol=2e-5)
    y_r, h_r = mamba.ssd_recurrent(x, dt, a, b, c, h0)
    np.testing.assert_allclose(np.asarray(y_r), want_y, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(h_r), want_h, rtol=2e-5, atol=2e-5)


def test_strong_decay_stays_finite():
    """Large dt * |A| inside a long chunk: the segment sums never subtract two large cumulative
    sums, so no inf - inf; the state is the last inputs' alone."""
    x, dt, a, b, c, h0 = _scan_inputs(np.random.default_rng(0), 1, 64)
    dt = dt * 40.0
    want_y, want_h = _oracle(x, dt, a, b, c, h0)
    y, h = mamba.ssd_chunked(*map(jnp.asarray, (x, dt, a, b, c)), 64, jnp.asarray(h0))
    assert np.isfinite(np.asarray(y)).all()
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-4, atol=1e-4)


SHAPE = dict(
    hidden_size=24,
    mamba_num_heads=4,
    mamba_head_dim=6,
    n_groups=2,
    ssm_state_size=5,
    conv_kernel=4,
    chunk_size=4,
    layer_norm_epsilon=1e-5,
)


def _torch_mixer(seed: int, conv_bias: bool = True):
    torch = pytest.importorskip("torch")
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    config = NemotronHConfig(
        **SHAPE, hybrid_override_pattern="M", use_conv_bias=conv_bias, time_step_min=1e-3, vocab_size=32
    )
    torch.manual_seed(seed)
    module = NemotronHMamba2Mixer(config, layer_idx=0).float().eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "proj" in name or "conv" in name else 1.0))
        module.dt_bias.copy_(module.dt_bias.abs() + 0.5)  # dt well above time_step_min (see the docstring)
    return module


def _ours(module, conv_bias: bool = True):
    params = {
        k: jnp.asarray(v.detach().numpy())
        for k, v in dict(
            conv1d_weight=module.conv1d.weight[:, 0, :],
            dt_bias=module.dt_bias,
            A_log=module.A_log,
            D=module.D,
            norm_weight=module.norm.weight,
        ).items()
    }
    if conv_bias:
        params["conv1d_bias"] = jnp.asarray(module.conv1d.bias.detach().numpy())
    shape = mamba.MambaShape(
        heads=SHAPE["mamba_num_heads"],
        head_dim=SHAPE["mamba_head_dim"],
        groups=SHAPE["n_groups"],
        state=SHAPE["ssm_state_size"],
        conv_kernel=SHAPE["conv_kernel"],
        chunk=SHAPE["chunk_size"],
        eps=SHAPE["layer_norm_epsilon"],
    )
    w_in = jnp.asarray(module.in_proj.weight.detach().numpy())
    w_out = jnp.asarray(module.out_proj.weight.detach().numpy())
    return params, shape, w_in, w_out


def _run(params, shape, w_in, w_out, hidden, mask=None, state=None):
    if mask is not None:
        hidden = hidden * mask[..., None]
    y, state = mamba.mixer(hidden @ w_in.T, params, shape, mask_BxT=mask, state=state)
    return y @ w_out.T, state


@pytest.mark.parametrize("t, conv_bias", [(11, True), (8, True), (3, False)])
def test_mixer_equals_transformers(t, conv_bias):
    """fp32, a left-padded row beside a full one; chunk boundaries inside and at the end."""
    torch = pytest.importorskip("torch")
    module = _torch_mixer(t, conv_bias)
    params, shape, w_in, w_out = _ours(module, conv_bias)
    assert module.in_proj.weight.shape[0] == shape.in_proj_rows
    rng = np.random.default_rng(t)
    hidden = rng.standard_normal((2, t, SHAPE["hidden_size"])).astype(np.float32)
    mask = np.ones((2, t), np.float32)
    mask[1, : min(2, t - 1)] = 0.0
    with torch.no_grad():
        want = module(torch.from_numpy(hidden), attention_mask=torch.from_numpy(mask)).numpy()
    got, _ = _run(params, shape, w_in, w_out, jnp.asarray(hidden), jnp.asarray(mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=1e-4, atol=1e-5)


def test_decode_from_the_prefill_state_equals_recomputation():
    """A prefill of 6 positions, then 4 one-position steps (the recurrence), then a 3-position
    continuation (the chunked scan from a state): every output equals the full 13-position run."""
    params, shape, w_in, w_out = _ours(_torch_mixer(5))
    hidden = jnp.asarray(np.random.default_rng(5).standard_normal((2, 13, SHAPE["hidden_size"])), jnp.float32)
    full, full_state = _run(params, shape, w_in, w_out, hidden)
    out, state = _run(params, shape, w_in, w_out, hidden[:, :6])
    pieces = [out]
    for t in range(6, 10):
        out, state = _run(params, shape, w_in, w_out, hidden[:, t : t + 1], state=state)
        pieces.append(out)
    out, state = _run(params, shape, w_in, w_out, hidden[:, 10:], state=state)
    pieces.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=1)), np.asarray(full), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.ssm_BxHxPxN), np.asarray(full_state.ssm_BxHxPxN), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.conv_BxKxC), np.asarray(full_state.conv_BxKxC), rtol=1e-6)


def test_dt_limit_follows_the_config():
    dt = jnp.asarray([[[-30.0, 0.0, 30.0]]])
    bias = jnp.zeros(3)
    np.testing.assert_allclose(
        np.asarray(mamba.step_size(dt, bias, (0.0, float("inf")))),
        np.log1p(np.exp(np.asarray(dt, np.float64))),
        rtol=1e-6,
    )
    np.testing.assert_allclose(np.asarray(mamba.step_size(dt, bias, (0.01, 0.5))), [[[0.01, 0.5, 0.5]]])


def test_in_proj_pieces():
    shape = mamba.MambaShape(heads=128, head_dim=80, groups=8, state=128, conv_kernel=4, chunk=128)
    assert [r for _, r in shape.pieces()] == [10240, 10240, 1024, 1024, 128]
    assert shape.in_proj_rows == sum(r for _, r in shape.pieces()) == 22656
    assert shape.conv_dim == 12288


@pytest.mark.parametrize(
    "n_group, topk_group, normalize, scaling", [(1, 1, True, 1.0), (4, 2, True, 2.5), (4, 1, False, 1.0)]
)
def test_grouped_sigmoid_router_equals_transformers(n_group, topk_group, normalize, scaling):
    """Nemotron-H's MoE router (the other hybrid piece that is not a linear): the correction bias
    chooses the experts (group-limited when n_group > 1), the unbiased scores weigh them."""
    torch = pytest.importorskip("torch")
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from nvfp4tool.model.layers import route_grouped_sigmoid

    config = NemotronHConfig(
        hidden_size=16,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=normalize,
        routed_scaling_factor=scaling,
        hybrid_override_pattern="E",
        vocab_size=32,
    )
    router = NemotronHTopkRouter(config)
    torch.manual_seed(n_group * 10 + topk_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
        router.e_score_correction_bias.copy_(torch.randn(16) * 0.5)  # large enough to change choices
    hidden = torch.randn(2, 7, 16)
    with torch.no_grad():
        logits, weights, index = router(hidden)
    want = np.zeros((14, 16), np.float32)
    np.put_along_axis(want, index.numpy(), weights.numpy(), axis=-1)
    got, chosen = route_grouped_sigmoid(
        jnp.asarray(logits.numpy()),
        3,
        correction_bias_N=jnp.asarray(router.e_score_correction_bias.numpy()),
        n_group=n_group,
        topk_group=topk_group,
        normalize=normalize,
        scaling=scaling,
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
    assert (np.asarray(chosen) == (want > 0)).all() and np.asarray(chosen).sum(-1).tolist() == [3] * 14
    unbiased = np.asarray(jax.lax.top_k(jax.nn.sigmoid(jnp.asarray(logits.numpy())), 3)[1])
    assert (np.sort(unbiased, -1) != np.sort(index.numpy(), -1)).any()  # the bias did change a choice


def test_the_flax_mixer_on_the_linear_seam_equals_transformers():
    """`Mamba2Mixer` with transformers' parameters loaded under their HF names: in_proj and out_proj
    go through the seam (every call recorded), the output equals NemotronHMamba2Mixer's."""
    torch = pytest.importorskip("torch")
    from flax import nnx

    from nvfp4tool.model.linear import Seam

    module = _torch_mixer(7)
    _, shape, _, _ = _ours(module)
    ours = mamba.Mamba2Mixer(
        SHAPE["hidden_size"],
        shape,
        prefix="model.layers.0.mixer",
        use_bias=False,
        conv_bias=True,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    state = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    assert set(state) == {
        "in_proj.weight",
        "conv1d.weight",
        "conv1d.bias",
        "dt_bias",
        "A_log",
        "D",
        "norm.weight",
        "out_proj.weight",
    }
    for name, value in state.items():
        target = ours
        *path, leaf = name.split(".")
        for attr in path:
            target = getattr(target, attr)
        assert getattr(target, leaf)[...].shape == value.shape, name
        getattr(target, leaf).set_value(jnp.asarray(value))
    seen = []

    def linear(x, w, b, *, name):
        seen.append(name)
        return x @ w.T

    hidden = np.random.default_rng(7).standard_normal((2, 9, SHAPE["hidden_size"])).astype(np.float32)
    mask = np.ones((2, 9), np.float32)
    mask[0, :3] = 0.0
    with torch.no_grad():
        want = module(torch.from_numpy(hidden), attention_mask=torch.from_numpy(mask)).numpy()
    got, _, _ = ours(jnp.asarray(hidden), Seam.of(linear), mask_BxT=jnp.asarray(mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=1e-4, atol=1e-5)
    assert seen == ["model.layers.0.mixer.in_proj", "model.layers.0.mixer.out_proj"]


def _load(ours, state: dict) -> None:
    """Set `ours`' parameters from a transformers state dict under HF's names (experts stored 3D
    there, [E, out, in], are each expert's `experts.{e}.<proj>.weight` here, as on disk)."""
    flat = {}
    for name, value in state.items():
        if name in ("experts.up_proj", "experts.down_proj"):
            proj = name.split(".")[1]
            flat.update({f"experts.{e}.{proj}.weight": value[e] for e in range(value.shape[0])})
        else:
            flat[name] = value
    for name, value in flat.items():
        target = ours
        *path, leaf = name.split(".")
        for attr in path:
            target = target[int(attr)] if attr.isdigit() else getattr(target, attr)
        assert getattr(target, leaf)[...].shape == value.shape, name
        getattr(target, leaf).set_value(jnp.asarray(value))


@pytest.mark.parametrize("latent, n_group", [(None, 1), (16, 2)])
def test_hybrid_moe_mlp_and_norm_equal_transformers(latent, n_group):
    """fp32: the relu2 MLP, the norm (weight multiplied in fp32) and the MoE mixer (grouped
    routing, correction bias, latent projections, shared expert), parameters loaded by HF name."""
    torch = pytest.importorskip("torch")
    from flax import nnx
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMLP, NemotronHMoE, NemotronHRMSNorm

    from nvfp4tool.families.nemotron_h import parse_hybrid
    from nvfp4tool.model import hybrid
    from nvfp4tool.model.layers import RMSNorm
    from nvfp4tool.model.linear import Seam

    hf = dict(
        hidden_size=24,
        intermediate_size=40,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=12,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=20,
        moe_latent_size=latent,
        n_group=n_group,
        topk_group=1,
        routed_scaling_factor=2.0,
        norm_topk_prob=True,
        mlp_bias=False,
        mamba_num_heads=4,
        mamba_head_dim=6,
        ssm_state_size=5,
        n_groups=2,
    )
    config = NemotronHConfig(**hf, hybrid_override_pattern="E-", vocab_size=32)
    experts = parse_hybrid({**hf, "hybrid_override_pattern": "E-"}, "config.json").experts
    torch.manual_seed(n_group)
    torch_moe, torch_mlp = NemotronHMoE(config, layer_idx=0).float(), NemotronHMLP(config).float()
    torch_norm = NemotronHRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        for module in (torch_moe, torch_mlp, torch_norm):
            for p in module.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        torch_moe.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    rngs = nnx.Rngs(0)
    moe = hybrid.HybridMoE(
        24, experts, prefix="model.layers.0.mixer", mlp_bias=False, param_dtype=jnp.float32, rngs=rngs
    )
    mlp = hybrid.ReLU2MLP(24, 40, prefix="model.layers.1.mixer", bias=False, param_dtype=jnp.float32, rngs=rngs)
    norm = RMSNorm(24, eps=1e-5, param_dtype=jnp.float32, scale_in_fp32=True)
    for ours, theirs in ((moe, torch_moe), (mlp, torch_mlp), (norm, torch_norm)):
        _load(ours, {k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    x = np.random.default_rng(n_group).standard_normal((2, 5, 24)).astype(np.float32)
    seen = []

    def linear(x, w, b, *, name):
        seen.append(name)
        return x @ w.T + (0 if b is None else b)

    seam = Seam.of(linear)
    with torch.no_grad():
        want = [m(torch.from_numpy(x)).numpy() for m in (torch_moe, torch_mlp, torch_norm)]
    got = [
        np.asarray(moe(jnp.asarray(x), seam)[0]),
        np.asarray(mlp(jnp.asarray(x), seam)[0]),
        np.asarray(norm(jnp.asarray(x))),
    ]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert "model.layers.0.mixer.experts.7.down_proj" in seen and "model.layers.0.mixer.gate" in seen
    assert ("model.layers.0.mixer.fc1_latent_proj" in seen) == (latent is not None)
