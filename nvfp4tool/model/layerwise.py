"""Run a model layer by layer over token windows, its weights held whole or read one layer at a time.

    model = LayerwiseModel.open(config, build=..., source=..., offload="auto", ...)  # held or streamed
    for start, logits_BxTxV in model.logits(ids_SxT, batch_size=4, tap=Plain(served_linear)):
        ...

Both modes run the same compiled block program (the same numbers); `sequential` is GPTQ's pass;
`layer_inputs` caches each layer's input, `logits_from` runs from one layer on (auto-precision).
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4tool import memory, progress
from nvfp4tool.config import ModelConfig
from nvfp4tool.families import BASE_MODEL, LM_HEAD, layer_index, layer_prefix
from nvfp4tool.model.attention import AttentionMask
from nvfp4tool.model.linear import KVTap, PlainKV, Seam, Tap
from nvfp4tool.model.rope import layer_cos_sin
from nvfp4tool.model.sharding import model_mesh, replicated, shard
from nvfp4tool.model.transformer import (
    CausalLM,
    abstract_block,
    block_program,
    default_positions,
    embed,
    layer_program,
    lm_logits,
    real_name,
    rope,
    without_layers,
)
from nvfp4tool.model.weights import as_param
from nvfp4tool.numerics import computed_after

STAR = layer_prefix("*")  # the layer prefix of the names a block program sees
FORWARD_MARGIN = 1.25  # held_forward_bytes' margin over the larger phase (measured: 1.1-1.3x on tiny / small)


def held_forward_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    """Memory a held model's `logits` needs besides its weights for one batch of `batch_size` rows
    of `seq_len` tokens. Its two phases never overlap, so the larger counts, with a margin: a layer
    (fp32 activations, the MLP's gate / up / product, the attention's fp32 scores and
    probabilities [B, H, T, T]) or the LM head (fp32 logits [B, T, V]); plus the weight block
    widened for a GEMM (`numerics.dot.widened_bytes`) and the largest tensor read from its file."""
    from nvfp4tool.numerics.dot import widened_bytes

    tokens = batch_size * seq_len
    layer = 4 * tokens * (3 * config.intermediate_size + 6 * config.hidden_size)
    layer += 2 * 4 * batch_size * config.num_heads * seq_len * seq_len
    head = 4 * tokens * (config.vocab_size + config.hidden_size)
    largest = max(config.vocab_size, config.intermediate_size) * config.hidden_size
    return int(FORWARD_MARGIN * max(layer, head)) + widened_bytes(largest) + 2 * largest


def streamed_bytes(config: ModelConfig, stored: dict[str, int], samples: int, seq_len: int) -> int:
    """Memory a streamed model's `logits` holds besides a batch's working set, for `samples`
    windows of `seq_len` tokens: the outer tensors (embeddings, final norm, LM head) and the
    largest decoder layer as stored (`stored`: {tensor name: bytes}), and every window's hidden
    state in fp32 between layers (all windows go through one layer together)."""
    layers: dict[int, int] = {}
    outer = 0
    for name, nbytes in stored.items():
        i = layer_index(name)
        if i is None:
            outer += nbytes
        else:
            layers[i] = layers.get(i, 0) + nbytes
    return outer + max(layers.values(), default=0) + 4 * samples * seq_len * config.hidden_size


class LayerwiseModel:
    """A decoder whose layers run one at a time (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        outer: CausalLM,
        layer: Callable[[int], nnx.State],
        *,
        streamed: bool,
        mesh: jax.sharding.Mesh | None = None,
        whole: CausalLM | None = None,
    ) -> None:
        self.config, self.streamed, self.mesh = config, streamed, mesh
        self.whole = whole  # the held CausalLM (for generation); None when streamed
        self._layer = layer
        self._outer_graphdef, self._outer_state = nnx.split(outer)
        self._outer_state = self._place(self._outer_state)
        # one block program per kind and attention settings of a layer (`layer_program`), shared by
        # all layers alike
        self._block_graphdefs = {
            key: block_program(config, *key) for key in {layer_program(config, i) for i in range(config.num_layers)}
        }
        self._gather = None if mesh is None else replicated(mesh)

    @classmethod
    def open(
        cls,
        config: ModelConfig,
        *,
        build: Callable[[jax.sharding.Mesh | None], CausalLM],
        source: Any,
        offload: str,
        what: str,
        weights: int,
        working: int,
        compute_dtype: jnp.dtype,
        streamed: int | None = None,
    ) -> LayerwiseModel:
        """Held (`build(mesh)`) or streamed from `source`, as `memory.choose_offload`
        decides for `weights` bytes as stored and `working` bytes per device (`streamed`: the
        estimate of a streamed run, said beside); on several devices, sharded over all of them
        (`model.sharding.model_mesh`; said)."""
        mesh = model_mesh()
        devices = 1 if mesh is None else mesh.size
        if mesh is not None:
            progress.info(f"{what}: sharded over {devices} devices (fsdp)")
        if memory.choose_offload(
            offload, weights=weights, working=working, what=what, devices=devices, streamed=streamed
        ):
            return cls.streamed(config, source, compute_dtype=compute_dtype, mesh=mesh)
        progress.info(f"loading {what}")
        return cls.held(build(mesh), mesh=mesh)

    @classmethod
    def held(cls, model: CausalLM, *, mesh: jax.sharding.Mesh | None = None) -> LayerwiseModel:
        """A model in memory, run layer by layer `batch_size` windows at a time."""
        layers = model.layers
        return cls(
            model.config, without_layers(model), lambda i: nnx.state(layers[i]), streamed=False, mesh=mesh, whole=model
        )

    @classmethod
    def streamed(
        cls, config: ModelConfig, source: Any, *, compute_dtype: jnp.dtype, mesh: jax.sharding.Mesh | None = None
    ) -> LayerwiseModel:
        """Weights read from `source.get(HF name)` (arrays kept in their stored dtype, stored
        quantized weights as they are): the outer tensors once, each layer when it runs."""
        outer = nnx.eval_shape(lambda: CausalLM(config, param_dtype=jnp.float32, compute_dtype=compute_dtype))
        outer.layers = nnx.List([])
        for name in config.expected_tensor_shapes():
            if layer_index(name) is None:
                _variable(outer, name.removeprefix(f"{BASE_MODEL}.")).set_value(as_param(source.get(name), None, mesh))

        def layer(i: int) -> nnx.State:
            block = abstract_block(config, *layer_program(config, i))
            for path in _param_paths(block):
                _variable(block, path).set_value(as_param(source.get(f"{layer_prefix(i)}.{path}"), None, mesh))
            return nnx.state(block)

        return cls(config, outer, layer, streamed=True, mesh=mesh)

    def logits(
        self,
        ids_SxT: np.ndarray,
        batch_size: int,
        *,
        tap: Tap,
        aux: Callable[[int | None], Any] | None = None,
        on_record: Callable[[str, Any], None] | None = None,
        kv_tap: KVTap | None = None,
        label: str = "forward",
        all_experts: bool = False,
    ) -> Iterator[tuple[int, jax.Array]]:
        """(first window index, fp32 logits [B, T, V]) of every batch of `batch_size` windows, in
        order; records of the tap (and of `kv_tap`, keys and values as they are cached; None: the
        identity) go to `on_record(name, record)` (one call per batch). `all_experts`: every sparse
        MLP shows every token to every expert (calibration; `Seam.all_experts`)."""
        ids_SxT = np.asarray(ids_SxT, np.int32)
        S, T = ids_SxT.shape
        wave = S if self.streamed else batch_size  # windows that go through one layer together
        layers = self.config.num_layers
        aux = aux or (lambda i: None)
        # what the task counts: streamed, all windows go through one layer at a time (layers);
        # held, each batch of windows goes through every layer in turn (windows)
        total, unit = (layers, "layer") if self.streamed else (S, "window")
        with progress.task(label, total=total, unit=unit) as task:
            started, layer_tokens = time.perf_counter(), 0
            for w0 in range(0, S, wave):
                starts = list(range(w0, min(w0 + wave, S), batch_size))
                carry = [self._embed(ids_SxT[s : s + batch_size]) for s in starts]
                for i in range(layers):
                    state, layer_aux = self._place(self._layer(i)), self._place(aux(i))
                    graphdef = self._block_graphdefs[layer_program(self.config, i)]
                    for b, (x, tables, mask) in enumerate(carry):
                        cos, sin = layer_cos_sin(self.config, tables, i)
                        with progress.compiling(
                            f"{label} layer program",
                            key=_program_key(_block_step, graphdef, tap, kv_tap, self._gather, x, all_experts),
                        ):
                            y, records = _block_step(
                                graphdef,
                                state,
                                x,
                                cos,
                                sin,
                                mask,
                                layer_aux,
                                tap=tap,
                                kv_tap=kv_tap,
                                gather=self._gather,
                                all_experts=all_experts,
                            )
                        carry[b] = (y, tables, mask)
                        _deliver(records, on_record, i)
                    del state, layer_aux  # a streamed layer's weights go now
                    if self.streamed:
                        memory.release()
                    layer_tokens += (min(w0 + wave, S) - w0) * T
                    rate = layer_tokens / layers / (time.perf_counter() - started)
                    if self.streamed:
                        task.advance(description=f"layer {i}", fields={"tokens/s": f"{rate:.0f}"})
                if not self.streamed:
                    rate = layer_tokens / layers / (time.perf_counter() - started)
                    task.advance(
                        min(w0 + wave, S) - w0,
                        description=f"windows {w0}-{min(w0 + wave, S) - 1}",
                        fields={"tokens/s": f"{rate:.0f}"},
                    )
                head_aux = self._place(aux(None))
                for s, (x, _, _) in zip(starts, carry):
                    with progress.compiling(
                        f"{label} LM head",
                        key=_program_key(_head_step, self._outer_graphdef, tap, None, self._gather, x),
                    ):
                        logits, records = _head_step(
                            self._outer_graphdef, self._outer_state, x, head_aux, tap=tap, gather=self._gather
                        )
                    _deliver(records, on_record, None)
                    yield s, logits
                del carry

    def layer_inputs(
        self,
        ids_SxT: np.ndarray,
        batch_size: int,
        *,
        tap: Tap,
        aux: Callable[[int | None], Any] | None = None,
        kv_tap: KVTap | None = None,
        label: str = "layer inputs",
    ) -> LayerInputs:
        """Every decoder layer's input hidden states for the windows (`batch_size` at a time), the
        model run with `tap`, `kv_tap` (None: the identity) and `aux(i)`: for `logits_from`, which
        runs only the layers from one on. Holds num_layers x S x T x hidden fp32 (the caller sizes
        the windows)."""
        ids_SxT = np.asarray(ids_SxT, np.int32)
        starts = list(range(0, len(ids_SxT), batch_size))
        carry = [self._embed(ids_SxT[s : s + batch_size]) for s in starts]
        inputs = LayerInputs(starts=starts, context=[(t, m) for _, t, m in carry], hidden=[])
        xs = [x for x, _, _ in carry]
        for i in range(self.config.num_layers):
            inputs.hidden.append(xs)
            xs = self._layer_outputs(i, xs, inputs.context, tap, kv_tap, (aux or (lambda i: None))(i), label)
        return inputs

    def logits_from(
        self,
        inputs: LayerInputs,
        layer: int,
        *,
        tap: Tap,
        aux: Callable[[int | None], Any],
        kv_tap: KVTap | None = None,
        label: str = "forward",
    ) -> Iterator[tuple[int, jax.Array]]:
        """(first window index, fp32 logits [B, T, V]) of every batch of `inputs`, run from decoder
        layer `layer`'s cached input through the later layers and the LM head with `tap`, `kv_tap`
        (None: the identity) and `aux(i)` (None: the head); the layers before `layer` are not run."""
        xs = inputs.hidden[layer]
        for i in range(layer, self.config.num_layers):
            xs = self._layer_outputs(i, xs, inputs.context, tap, kv_tap, aux(i), label)
        head_aux = self._place(aux(None))
        for s, x in zip(inputs.starts, xs):
            with progress.compiling(
                f"{label} LM head", key=_program_key(_head_step, self._outer_graphdef, tap, None, self._gather, x)
            ):
                logits, _ = _head_step(
                    self._outer_graphdef, self._outer_state, x, head_aux, tap=tap, gather=self._gather
                )
            yield s, logits

    def _layer_outputs(
        self, i: int, xs: list, context: list, tap: Tap, kv_tap: KVTap | None, aux: Any, label: str
    ) -> list:
        """Layer i's outputs for the batches `xs` (their RoPE tables and masks `context`), records dropped."""
        state, layer_aux = self._place(self._layer(i)), self._place(aux)
        graphdef = self._block_graphdefs[layer_program(self.config, i)]
        out = []
        for x, (tables, mask) in zip(xs, context):
            cos, sin = layer_cos_sin(self.config, tables, i)
            with progress.compiling(
                f"{label} layer program", key=_program_key(_block_step, graphdef, tap, kv_tap, self._gather, x)
            ):
                y, _ = _block_step(
                    graphdef, state, x, cos, sin, mask, layer_aux, tap=tap, kv_tap=kv_tap, gather=self._gather
                )
            out.append(y)
        del state, layer_aux
        if self.streamed:
            memory.release()
        return out

    def sequential(
        self,
        ids_SxT: np.ndarray,
        batch_size: int,
        *,
        tap: Tap,
        replay: Tap,
        on_record: Callable[[str, Any], None],
        replace: Callable[[int], dict[str, np.ndarray]],
        label: str = "sequential",
        reference: Tap | None = None,
        kv_tap: KVTap | None = None,
        on_reference: Callable[[str, Any], None] | None = None,
        all_experts: bool = False,
    ) -> None:
        """GPTQ's sequential pass: for each layer i, all windows go through layer i (its weights as
        stored, `batch_size` windows at a time) with `tap`, its records going to `on_record`; then
        `replace(i)` gives new values of some of its parameters ({path inside the layer, e.g.
        "self_attn.q_proj.weight": array}); when it gives any, the windows go through layer i
        again with them and the tap `replay` (meant to record nothing; its records are dropped) to
        make layer i+1's inputs. So layer i+1's records see
        the replaced earlier layers. With `reference`, a second copy of the windows goes through
        every layer first with its weights as stored (never replaced), with that tap and `kv_tap`,
        their records going to `on_reference`: what the original model computes (calibration), in
        the same pass, exactly as `logits` computes it (`all_experts`: as there). Held or streamed alike; the peak is
        one layer (twice while it
        is replaced) + the activations of all windows (twice with `reference`). The LM head is not run."""
        ids_SxT = np.asarray(ids_SxT, np.int32)
        carry = [self._embed(ids_SxT[s : s + batch_size]) for s in range(0, len(ids_SxT), batch_size)]
        original = list(carry) if reference is not None else []  # the windows through the stored layers
        with progress.task(label, total=self.config.num_layers, unit="layer") as task:
            for i in range(self.config.num_layers):
                graphdef = self._block_graphdefs[layer_program(self.config, i)]
                state = self._place(self._layer(i))
                for b, (x, tables, mask) in enumerate(original):
                    cos, sin = layer_cos_sin(self.config, tables, i)
                    with progress.compiling(
                        f"{label} layer program (reference)",
                        key=_program_key(_block_step, graphdef, reference, kv_tap, self._gather, x, all_experts),
                    ):
                        y, records = _block_step(
                            graphdef,
                            state,
                            x,
                            cos,
                            sin,
                            mask,
                            None,
                            tap=reference,
                            kv_tap=kv_tap,
                            gather=self._gather,
                            all_experts=all_experts,
                        )
                    _deliver(records, on_reference, i)
                    original[b] = (y, tables, mask)
                outputs = []
                for x, tables, mask in carry:
                    cos, sin = layer_cos_sin(self.config, tables, i)
                    with progress.compiling(
                        f"{label} layer program",
                        key=_program_key(_block_step, graphdef, tap, None, self._gather, x, all_experts),
                    ):
                        y, records = _block_step(
                            graphdef,
                            state,
                            x,
                            cos,
                            sin,
                            mask,
                            None,
                            tap=tap,
                            kv_tap=None,
                            gather=self._gather,
                            all_experts=all_experts,
                        )
                    _deliver(records, on_record, i)
                    outputs.append(y)
                new = replace(i)
                if new:
                    block = nnx.merge(graphdef, state)
                    for path, value in new.items():
                        variable = _variable(block, path)
                        variable.set_value(jnp.asarray(value, variable.get_value().dtype))
                    state = self._place(nnx.state(block))
                    del block
                    outputs = []
                    for x, tables, mask in carry:
                        cos, sin = layer_cos_sin(self.config, tables, i)
                        with progress.compiling(
                            f"{label} layer program (replay)",
                            key=_program_key(_block_step, graphdef, replay, None, self._gather, x, all_experts),
                        ):
                            outputs.append(
                                _block_step(
                                    graphdef,
                                    state,
                                    x,
                                    cos,
                                    sin,
                                    mask,
                                    None,
                                    tap=replay,
                                    kv_tap=None,
                                    gather=self._gather,
                                    all_experts=all_experts,
                                )[0]
                            )
                carry = [(y, tables, mask) for y, (_, tables, mask) in zip(outputs, carry)]
                del state, outputs
                if self.streamed:
                    memory.release()
                task.advance(description=f"layer {i}")

    def _embed(self, ids_BxT: np.ndarray):
        ids = jnp.asarray(ids_BxT) if self.mesh is None else jax.device_put(ids_BxT, replicated(self.mesh))
        return _embed_step(self._outer_graphdef, self._outer_state, ids, gather=self._gather)

    def _place(self, tree: Any) -> Any:
        """Weights on the mesh (fsdp layout; already placed ones stay) or the default device."""
        if tree is None:
            return None
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return shard(self.mesh, tree)


@dataclasses.dataclass
class LayerInputs:
    """`LayerwiseModel.layer_inputs`: per batch its first window index and (RoPE tables, mask);
    `hidden[i]`: decoder layer i's input, one array per batch."""

    starts: list[int]
    context: list[tuple[Any, Any]]
    hidden: list[list[jax.Array]]


# ------------------------------------------------------------------------------------------
# helpers


def layer_modules(modules, layer: int | None) -> dict[str, str]:
    """{name as the block program sees it: module} of the `modules` in decoder layer `layer` (None:
    the LM head, whose program sees its own name)."""
    if layer is None:
        return {m: m for m in modules if m == LM_HEAD}
    prefix = f"{layer_prefix(layer)}."
    return {f"{STAR}.{m[len(prefix) :]}": m for m in modules if m.startswith(prefix)}


def _param_paths(module: nnx.Module) -> list[str]:
    """Dotted attribute paths of a module's parameters (= HF name suffixes)."""
    return [".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))]


def _variable(module: nnx.Module, path: str) -> nnx.Variable:
    node = module
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def _program_key(step, graphdef, tap, kv_tap, gather, x: jax.Array, all_experts: bool = False) -> tuple:
    """What makes a step compile anew, for `progress.compiling`: the program and its static
    arguments, and the batch's shape and dtype (the weights' shapes follow from the graphdef)."""
    return step, graphdef, tap, kv_tap, gather, tuple(x.shape), str(x.dtype), all_experts


def _deliver(records: dict[str, Any], on_record, layer: int | None) -> None:
    if on_record is None:
        return
    for name, record in records.items():
        on_record(real_name(name, layer), record)


@dataclasses.dataclass
class _InOrder:
    """The block's tap, its linears run one after another: each one's tap (its weights widened or
    decoded, its GEMMs) is computed after the previous linear's output (`numerics.computed_after`),
    so the program holds the widened weights of one linear at a time, not those of q, k and v (or
    gate and up), which share their input (a 2048 / 5632 layer with validate's SQNR tap: 222 MB of
    temporaries -> 75 MB). Made inside one step's trace, for that trace only."""

    tap: Tap
    outputs: list = dataclasses.field(default_factory=list)

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        def run(x, w_NxK, b_N, aux):
            return self.tap(x, w_NxK, b_N, name=name, aux=aux)

        y, record = (
            computed_after(self.outputs[-1], run, x, w_NxK, b_N, aux) if self.outputs else run(x, w_NxK, b_N, aux)
        )
        self.outputs.append(y)
        return y, record


def _seam(tap: Tap, kv_tap: KVTap | None, aux: Any, all_experts: bool) -> Seam:
    return Seam(_InOrder(tap), kv_tap or PlainKV(), all_experts=all_experts, aux_of=lambda layer: aux, aux=aux)


@partial(jax.jit, static_argnames=("graphdef", "gather"))
def _embed_step(graphdef, state, ids_BxT, *, gather):
    state = _gathered(state, gather)
    model = nnx.merge(graphdef, state)
    tables = rope(model, default_positions(jnp.ones(ids_BxT.shape, bool)))
    return embed(model, ids_BxT), tables, AttentionMask.causal()


@partial(jax.jit, static_argnames=("graphdef", "tap", "kv_tap", "gather", "all_experts"))
def _block_step(graphdef, state, x_BxTxE, cos_BxTxD, sin_BxTxD, mask, aux, *, tap, kv_tap, gather, all_experts=False):
    state, aux = _gathered((state, aux), gather)
    y_BxTxE, _, side = nnx.merge(graphdef, state)(
        x_BxTxE, cos_BxTxD, sin_BxTxD, mask, None, 0, _seam(tap, kv_tap, aux, all_experts)
    )
    return y_BxTxE, side.records


@partial(jax.jit, static_argnames=("graphdef", "tap", "gather"))
def _head_step(graphdef, state, x_BxTxE, aux, *, tap, gather):
    state, aux = _gathered((state, aux), gather)
    logits, side = lm_logits(nnx.merge(graphdef, state), x_BxTxE, _seam(tap, None, aux, False))
    return logits, side.records


def _gathered(tree: Any, gather: jax.sharding.NamedSharding | None) -> Any:
    """Inside a step: the weights all-gathered (FSDP: sharded at rest, whole while their layer
    runs), so each device computes exactly what one device computes."""
    return tree if gather is None else jax.lax.with_sharding_constraint(tree, gather)
