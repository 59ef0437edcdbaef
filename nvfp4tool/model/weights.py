"""HF-named tensors <-> model parameters (both directions).

The model's attribute paths mirror HF names, so `model.layers.3.self_attn.q_proj.weight` names
`model.layers[3].self_attn.q_proj.weight`, scanned layers or not (a scanned model keeps its
parameters per layer and stacks a run's inside its program). Tensors are read one at a time from the source;
the model itself is the only full copy held.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters.tensor_source import TensorSource, check_against_config
from nvfp4tool import progress
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import BASE_MODEL, LM_HEAD, split_layer
from nvfp4tool.model.linear import LinearFn, default_linear
from nvfp4tool.model.sharding import shard
from nvfp4tool.model.transformer import CausalLM


def model_from_tensors(
    config: ModelConfig,
    source: TensorSource,
    *,
    dtype: jnp.dtype | None = jnp.float32,
    compute_dtype: jnp.dtype | None = None,
    scan_layers: bool = False,
    remat: str = "none",
    linear: LinearFn = default_linear,
    check: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> CausalLM:
    """Build the model from HF-named tensors (every shape checked against `config` first).

    dtype: parameter dtype (values are cast exactly when widening, e.g. bf16 -> fp32); None keeps
    each tensor as stored (a model held in its stored dtypes: a BF16 checkpoint stays BF16, and a
    `get` that returns a stored quantized weight, a pytree the linear seam decodes, is kept as
    it is). compute_dtype: activations / matmul inputs (default: dtype, required when dtype is
    None). remat: what training's backward pass recomputes (`remat.py`). check=False skips the
    shape check (for sources already checked, e.g. an export).
    mesh: each tensor goes from the host straight to its shards over the mesh's devices as it is
    read (`as_param`), so the model is never whole on one device.
    """
    if dtype is None and compute_dtype is None:
        raise ValueError("model_from_tensors: dtype=None (as stored) needs a compute_dtype")
    expected = config.expected_tensor_shapes()
    if check:
        check_against_config(
            source,
            expected,
            ignore_extra=(f"{LM_HEAD}.weight",) if config.tie_word_embeddings else (),
            config=config,
        )
    model = nnx.eval_shape(
        lambda: CausalLM(
            config,
            param_dtype=dtype or jnp.float32,
            compute_dtype=compute_dtype,
            scan_layers=scan_layers,
            remat=remat,
            linear=linear,
        )
    )
    with progress.task("loading weights", total=len(expected), unit="tensor") as task:
        for name in expected:
            value = source.get(name)
            task.advance(description=name, nbytes=_nbytes(value))
            _locate(model, name).set_value(as_param(value, dtype, mesh))
    return model


def _nbytes(value) -> int:
    """The bytes of a tensor as read (an array, or a stored quantized weight's pytree)."""
    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(value))


def as_param(value, dtype: jnp.dtype | None, mesh: jax.sharding.Mesh | None = None):
    """A tensor as a parameter value: an array cast to `dtype` (None: as stored), or a stored
    quantized weight (a pytree) unchanged; on the default device, or with a `mesh` sent from the
    host straight to its fsdp shards (`model.sharding.shard`)."""
    if mesh is None:
        if isinstance(value, np.ndarray | jax.Array):
            return jnp.asarray(value, dtype=dtype)
        return jax.tree.map(jnp.asarray, value)
    if isinstance(value, np.ndarray | jax.Array):
        value = np.asarray(value, dtype=dtype)  # the same cast (widening exact, narrowing RNE) on the host
    return shard(mesh, value)


class ModelTensorSource:
    """A `TensorSource` view of a model's parameters (e.g. to write it with `write_hf_folder`)."""

    def __init__(self, model: CausalLM, path: str = "<model>") -> None:
        self._model = model
        self._shapes = model.config.expected_tensor_shapes()
        self._path = path

    @property
    def path(self) -> str:
        return self._path

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        self._check(name)
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return jnp.dtype(_locate(self._model, self._check(name))[...].dtype).name

    def get(self, name: str) -> np.ndarray:
        return np.asarray(_locate(self._model, self._check(name))[...])

    def _check(self, name: str) -> str:
        if name not in self._shapes:
            raise NVFP4ToolError(f"{self._path}: no tensor {name!r}")
        return name


def _locate(model: CausalLM, hf_name: str) -> nnx.Variable:
    """The parameter holding `hf_name` (every layer keeps its own, scanned or not)."""
    if hf_name == f"{LM_HEAD}.weight":
        return model.lm_head.weight
    in_layer = split_layer(hf_name)
    if in_layer:
        index, rest = in_layer
        node = model.layers[index]
    else:
        node, rest = model, hf_name.removeprefix(f"{BASE_MODEL}.")
    for part in rest.split("."):
        node = getattr(node, part)
    if not isinstance(node, nnx.Variable):
        raise NVFP4ToolError(f"<model>: {hf_name!r} is not a parameter")
    return node
