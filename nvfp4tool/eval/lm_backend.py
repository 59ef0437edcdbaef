"""An lm-evaluation-harness model backed by nvfp4tool: the BF16 source, an FP8 reference or an NVFP4
export run as served, through the same code.

    lm = NVFP4ToolLM(path="out/a-nvfp4")          # or NVFP4ToolLM(variant=open_variant(...))
    lm_eval.simple_evaluate(model=lm, tasks=["nvfp4tool_mc"], ...)
    python -m nvfp4tool.eval.lm_backend run --model nvfp4tool --model_args path=OUT --tasks ...

Every model computes in fp32 on its stored weights.
Design notes: docs/design/eval.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool import memory, progress
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.eval.gen_settings import boolean, check, integer

try:  # the optional extra `nvfp4tool[eval]`
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
except ImportError as missing:  # pragma: no cover - exercised only without the extra
    raise NVFP4UsageError("lm-eval is not installed: pip install 'nvfp4tool[eval]'") from missing

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")  # the shipped offline tasks
MIN_BUCKET = 32  # the shortest padded length of a loglikelihood / generation bucket


@dataclasses.dataclass
class Variant:
    """One model of an evaluation, opened and ready to run (see the module docstring)."""

    label: str  # "bf16" | "fp8" | "nvfp4" (default: the export's quant, e.g. "nvfp4-weight-only")
    path: str
    config: Any  # ModelConfig
    model: Any  # LayerwiseModel (held or streamed)
    tokenizer_dir: str
    kv_aux: Callable[[int | None], Any] | None = None  # the FP8 KV cache's per-layer scales
    kv_tap: Any = None  # ServedKVTap when the export's FP8 KV cache runs
    gen_kv: Any = None  # the KV seam of generation (a LayerKV) or None (plain cache)

    @property
    def how(self) -> str:
        return "streamed" if self.model.streamed else "held"


def working_bytes(config, batch_size: int, seq_len: int) -> int:
    """Memory a held model needs besides its weights for one batch of eval's loglikelihood rows
    (`layerwise.held_forward_bytes`: the larger of a layer's and the LM head's, not their sum)."""
    from nvfp4tool.model.layerwise import held_forward_bytes

    return held_forward_bytes(config, batch_size, seq_len)


def open_variant(
    path: str,
    *,
    label: str | None = None,
    offload: str = "auto",
    fp8_kv: bool = True,
    step: int | None = None,
    batch_size: int = 8,
    max_length: int = 2048,
    tokenizer_dir: str | None = None,
) -> Variant:
    """Open `path` as served (an export) or as the BF16 source (an HF folder / training run)."""
    from nvfp4tool.export.simulate import ServedKVTap
    from nvfp4tool.formats import is_quantized_export
    from nvfp4tool.model.layerwise import LayerwiseModel
    from nvfp4tool.validate.runner import VALIDATE_OPTIONS, VALIDATION_DTYPE, Candidate, source_bytes

    if offload not in memory.OFFLOAD_MODES:
        raise NVFP4UsageError(f"offload={offload}: expected one of {', '.join(memory.OFFLOAD_MODES)}")
    if not os.path.isdir(path):
        raise NVFP4ToolError(f"{path}: not a folder (expected an export or an HF / training-run folder)")
    if is_quantized_export(path):
        exported = Candidate.load(path).exported
        config, stored, source = exported.config, exported.stored_bytes(), exported
        build = lambda mesh: exported.model(VALIDATION_DTYPE, mesh)  # noqa: E731
        label = label or exported.quant
        tokenizer_dir = tokenizer_dir or path
        kv = fp8_kv and exported.kv_cache is not None
    else:
        from nvfp4tool.checkpoints import open_checkpoint
        from nvfp4tool.model import model_from_tensors

        checkpoint = open_checkpoint(path, step=step, options=VALIDATE_OPTIONS)
        config, stored, source = checkpoint.config, source_bytes(checkpoint), checkpoint.tensors

        def build(mesh):
            return model_from_tensors(config, checkpoint.tensors, dtype=None, compute_dtype=VALIDATION_DTYPE, mesh=mesh)

        label = label or "bf16"
        tokenizer_dir = tokenizer_dir or checkpoint.aux_dir or path
        kv = False
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")) and not os.path.isfile(
        os.path.join(tokenizer_dir, "tokenizer_config.json")
    ):
        raise NVFP4ToolError(
            f"{tokenizer_dir}: no tokenizer (tokenizer.json / tokenizer_config.json); "
            "lm-eval tasks need the model's tokenizer"
        )
    model = LayerwiseModel.open(
        config,
        build=build,
        source=source,
        offload=offload,
        what=f"{label} ({stored / 1e9:.2f} GB as stored)",
        weights=stored,
        working=working_bytes(config, batch_size, max_length),
        compute_dtype=VALIDATION_DTYPE,
    )
    variant = Variant(label=label, path=path, config=config, model=model, tokenizer_dir=tokenizer_dir)
    if kv:
        variant.kv_aux = exported.kv_aux
        variant.kv_tap, variant.gen_kv = ServedKVTap(), exported.served_kv()
    return variant


def task_manager(include: tuple[str, ...] = (), *, defaults: bool = True):
    """lm-eval's TaskManager over the shipped offline tasks (`TASKS_DIR`: nvfp4tool_mc,
    nvfp4tool_mc_letter, nvfp4tool_gsm, nvfp4tool_text), the task YAML files / folders in `include` and, with
    `defaults`, lm-eval's own tasks (indexing those takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[TASKS_DIR, *include], include_defaults=defaults)


def buckets(length: int, max_length: int) -> int:
    """The padded length of a bucket holding rows of `length` tokens (a power of two)."""
    padded = MIN_BUCKET
    while padded < length:
        padded *= 2
    return max(length, min(padded, max_length))


@register_model("nvfp4tool")
class NVFP4ToolLM(TemplateLM):
    """lm-eval's model interface over one nvfp4tool `Variant` (see the module docstring).

    model_args: path=FOLDER (export or BF16 source; `export=` is an alias), label=, offload=auto,
    fp8_kv=true, batch_size=8, max_length (default: the config's max_position_embeddings, at most
    4096), max_gen_toks=256, seed=0, add_bos_token=, share_prefixes=true (`shared_rows`)."""

    def __init__(
        self,
        path: str | None = None,
        export: str | None = None,
        variant: Variant | None = None,
        label: str | None = None,
        offload: str = "auto",
        fp8_kv: Any = True,
        batch_size: Any = 8,
        max_length: Any = None,
        max_gen_toks: Any = 256,
        seed: Any = 0,
        add_bos_token: Any = None,
        step: Any = None,
        share_prefixes: Any = True,
        device: Any = None,  # lm-eval's own settings, passed to every model: unused here
        max_batch_size: Any = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        if unknown:
            raise NVFP4UsageError(
                f"model_args {', '.join(sorted(unknown))}: unknown (accepted: {', '.join(model_args())})"
            )
        self.batch_size = _positive("batch_size", batch_size if batch_size not in (None, "auto") else 8)
        self._max_gen_toks = _positive("max_gen_toks", max_gen_toks)
        self.seed = integer(seed, "model_args seed")
        if not 0 <= self.seed < 2**32:
            raise NVFP4UsageError(f"model_args seed={seed}: must be in 0..2**32-1")
        self.share_prefixes = boolean(share_prefixes, "model_args share_prefixes")
        self.add_bos_token = None if add_bos_token is None else boolean(add_bos_token, "model_args add_bos_token")
        if variant is None:
            path = path or export
            if path is None:
                raise NVFP4UsageError("model_args: path=FOLDER (an export or a BF16 source) is required")
            limit = _positive("max_length", max_length) if max_length is not None else 4096
            variant = open_variant(
                path,
                label=label,
                offload=offload,
                fp8_kv=boolean(fp8_kv, "model_args fp8_kv"),
                step=None if step is None else integer(step, "model_args step"),
                batch_size=self.batch_size,
                max_length=limit,
            )
        self.variant = variant
        self._max_length = (
            _positive("max_length", max_length)
            if max_length is not None
            else min(variant.config.max_position_embeddings, 4096)
        )
        self.tokenizer = AutoTokenizer.from_pretrained(variant.tokenizer_dir)
        if self.tokenizer.eos_token_id is None:
            raise NVFP4ToolError(f"{variant.tokenizer_dir}: the tokenizer has no EOS token")
        if len(self.tokenizer) > variant.config.vocab_size:
            raise NVFP4ToolError(
                f"{variant.tokenizer_dir}: the tokenizer has {len(self.tokenizer)} tokens, the "
                f"model's vocabulary {variant.config.vocab_size}"
            )
        # gen_key(args) -> [(output tokens, ran to max_gen_toks)], one per time it was generated
        self.generated: dict[str, list[tuple[list[int], bool]]] = {}
        self.timing: dict[str, float] = {}  # request type -> seconds
        self.counts: dict[str, int] = {}  # request type -> requests

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> NVFP4ToolLM:
        """lm-eval's `--model_args` with its own settings (batch_size, max_batch_size, device)
        merged: a key in model_args wins over lm-eval's default `--batch_size 1`; the same key
        given both ways with two values is a usage error naming both."""
        args = lm_utils.simple_parse_args_string(arg_string)
        for key, value in (additional_config or {}).items():
            if value is None:
                continue
            if key in args and str(args[key]) != str(value) and not (key == "batch_size" and str(value) == "1"):
                raise NVFP4UsageError(f"{key} given twice: model_args {key}={args[key]} and --{key} {value}; give one")
            args.setdefault(key, value)
        return cls(**args)

    # ---------------------------------------------------------------- what lm-eval asks about
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not chat_template:
            return None
        return self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.tokenizer.chat_template:
            raise NVFP4UsageError(
                f"{self.variant.tokenizer_dir}: the tokenizer has no chat template (drop --apply_chat_template)"
            )
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        special = (
            {"add_special_tokens": add_special_tokens}
            if add_special_tokens is not None
            else {"add_special_tokens": self.add_bos_token}
            if self.add_bos_token is not None
            else {}
        )
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---------------------------------------------------------------- loglikelihood
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, override_bs: int | None = None, **kwargs
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), greedy) per (key, context ids, continuation ids)."""
        started = time.perf_counter()
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise NVFP4ToolError("loglikelihood: a request has an empty continuation")
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((whole[:-1], whole[1:], min(len(continuation), len(whole) - 1)))
        answered_by = (
            shared_rows([tuple(context) for _, context, _ in requests], [r[0] for r in rows])
            if self.share_prefixes
            else {i: [i] for i in range(len(rows))}
        )
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        by_bucket: dict[int, list[int]] = {}
        for i in sorted(answered_by, key=lambda i: -len(rows[i][0])):
            by_bucket.setdefault(buckets(len(rows[i][0]), self.max_length), []).append(i)
        answered = 0
        with progress.task("loglikelihood", total=len(rows), unit="request") as task:
            for length, members in by_bucket.items():
                pad = -len(members) % self.batch_size
                ids = np.zeros((len(members) + pad, length), np.int32)
                for r, i in enumerate(members + members[:1] * pad):
                    ids[r, : len(rows[i][0])] = rows[i][0]
                for start, logits in self.variant.model.logits(
                    ids,
                    self.batch_size,
                    tap=_served_tap(),
                    aux=self.variant.kv_aux,
                    kv_tap=self.variant.kv_tap,
                    label=f"{self.variant.label} forward",
                ):
                    logits = np.asarray(logits)
                    done = 0
                    for b in range(min(len(logits), len(members) - start)):
                        for i in answered_by[members[start + b]]:
                            results[i] = _score(logits[b], *rows[i])
                            done += 1
                    answered += done
                    task.advance(done, fields={"requests/s": f"{answered / (time.perf_counter() - started):.1f}"})
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        self._count("loglikelihood", len(rows), started)
        self.counts["loglikelihood_rows_run"] = self.counts.get("loglikelihood_rows_run", 0) + len(answered_by)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's total log-likelihood over lm-eval's disjoint rolling windows."""
        windows, owners = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            for window in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None,) + window)
                owners.append(r)
        scored = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for r, (logp, _) in zip(owners, scored):
            totals[r] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) continuations cut at EOS and the first stop string."""
        from nvfp4tool.export.simulate import for_generation, served_linear
        from nvfp4tool.model import generate

        held = self.variant.model.whole
        if held is None:
            raise NVFP4ToolError(
                f"{self.variant.label}: generative tasks need the whole model in memory; it is "
                "streamed layer by layer (offload=never, or a machine with more memory)"
            )
        held = for_generation(held, f"{self.variant.label} generation")  # stored weights decoded once if they fit
        started = time.perf_counter()
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        key = jax.random.key(self.seed)
        answered = 0
        with progress.task("generate", total=len(requests), unit="request") as task:
            for members in groups.values():
                how = decoding(requests[members[0]].args[1], self.max_gen_toks)
                until = handle_stop_sequences(how.until, eos=eos)
                max_gen = how.max_gen_toks
                if max_gen >= self.max_length:
                    raise NVFP4UsageError(f"max_gen_toks {max_gen} must be below max_length {self.max_length}")
                encoded = {
                    i: self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen)
                    for i in members
                }
                order = sorted(members, key=lambda i: -len(encoded[i]))
                # one padded length for the group: one compiled generation program per task
                length = buckets(len(encoded[order[0]]), self.max_length - max_gen)
                for c in range(0, len(order), self.batch_size):
                    chunk = order[c : c + self.batch_size]
                    rows = chunk + chunk[:1] * (self.batch_size - len(chunk))
                    ids = np.zeros((len(rows), length), np.int32)
                    mask = np.zeros((len(rows), length), bool)
                    for r, i in enumerate(rows):
                        ids[r, length - len(encoded[i]) :], mask[r, length - len(encoded[i]) :] = encoded[i], True
                    key, step_key = jax.random.split(key)
                    with progress.compiling(f"{self.variant.label} generation", key=("generate", length, max_gen)):
                        tokens = np.asarray(
                            generate(
                                held,
                                jnp.asarray(ids),
                                max_gen,
                                attention_mask=mask,
                                greedy=not how.sample,
                                temperature=how.temperature,
                                top_k=how.top_k,
                                key=step_key,
                                eos_token_id=self.eot_token_id,
                                linear=served_linear,
                                kv=self.variant.gen_kv or _default_kv(),
                            )
                        )
                    for r, i in enumerate(chunk):
                        row = tokens[r].tolist()
                        ended = self.eot_token_id in row
                        if ended:
                            row = row[: row.index(self.eot_token_id)]
                        decoded = self.tok_decode(row)
                        text = postprocess_generated_text(decoded, until, None)
                        self.generated.setdefault(gen_key(requests[i].args), []).append(
                            (self.tok_encode(text) if text != decoded else row, not ended and text == decoded)
                        )
                        results[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    answered += len(chunk)
                    task.advance(len(chunk), fields={"requests/s": f"{answered / (time.perf_counter() - started):.2f}"})
        self._count("generate_until", len(requests), started)
        return results  # type: ignore[return-value]

    def _count(self, kind: str, n: int, started: float) -> None:
        self.timing[kind] = self.timing.get(kind, 0.0) + time.perf_counter() - started
        self.counts[kind] = self.counts.get(kind, 0) + n


def shared_rows(contexts: list[tuple], inputs: list[list[int]]) -> dict[int, list[int]]:
    """{row to run: the requests its logits answer}. Requests sharing a context (lm-eval's choices of
    one item) whose input ids are a prefix of another's are answered by that longer row: a causal
    model's logits at a position depend only on the tokens up to it. With one-token continuations
    (letter answers) every choice of an item is one row."""
    answered_by: dict[int, list[int]] = {}
    groups: dict[tuple, list[int]] = {}
    for i, context in enumerate(contexts):
        groups.setdefault(context, []).append(i)
    for members in groups.values():
        runs: list[int] = []
        for i in sorted(members, key=lambda i: -len(inputs[i])):
            n = len(inputs[i])
            carrier = next((j for j in runs if inputs[j][:n] == inputs[i]), None)
            if carrier is None:
                runs.append(i)
                answered_by[i] = [i]
            else:
                answered_by[carrier].append(i)
    return answered_by


def _score(logits_TxV: np.ndarray, inputs: list[int], targets: list[int], n: int) -> tuple[float, bool]:
    """(sum of the last n targets' log-probabilities in float64, whether each is the argmax), read at
    the positions of `inputs` in a row of logits (of `inputs` or of a row that starts with them)."""
    positions = np.arange(len(inputs) - n, len(inputs))
    picked = logits_TxV[positions].astype(np.float64)
    logp = picked - _logsumexp(picked)
    wanted = np.asarray(targets[-n:])
    return float(logp[np.arange(n), wanted].sum()), bool(np.all(np.argmax(picked, axis=-1) == wanted))


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How a generation request decodes (lm-eval's generation kwargs, normalized as its backends do)."""

    until: Any  # stop strings (before EOS is added)
    max_gen_toks: int
    sample: bool  # do_sample with a temperature > 0 (do_sample at temperature 0 is greedy, as in lm-eval)
    temperature: float
    top_k: int | None


NEUTRAL_GEN_KWARGS = {"top_p": 1.0, "num_beams": 1, "repetition_penalty": 1.0, "typical_p": 1.0}


def decoding(gen_kwargs: dict[str, Any], default_max_gen_toks: int, origin: str = "generation kwargs") -> Decoding:
    """The `Decoding` of a request's generation kwargs, typed and range-checked by
    `gen_settings.check` (`origin` names where they came from); a setting this backend does not
    implement (top_p < 1, beams, penalties, ...) is refused, naming it, rather than silently ignored."""
    kwargs = normalize_gen_kwargs(check(gen_kwargs, origin), default_max_gen_toks)
    until = kwargs.pop("until", None)
    max_gen = int(kwargs.pop("max_gen_toks"))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    sample = bool(kwargs.pop("do_sample", False)) and temperature > 0
    top_k = kwargs.pop("top_k", None)
    unsupported = {k: v for k, v in kwargs.items() if NEUTRAL_GEN_KWARGS.get(k, object()) != v}
    if unsupported:
        raise NVFP4UsageError(
            "generation kwargs "
            + ", ".join(f"{k}={v}" for k, v in sorted(unsupported.items()))
            + ": not supported (nvfp4tool decodes greedily or samples with do_sample, "
            "temperature, top_k; stop strings until, max_gen_toks)"
        )
    return Decoding(
        until=until,
        max_gen_toks=max_gen,
        sample=sample,
        temperature=temperature if sample else 1.0,
        top_k=None if not top_k or not sample else int(top_k),  # 0: no restriction (as in HF)
    )


def gen_key(arguments) -> str:
    """The key of a generation request's (context, generation kwargs) in `NVFP4ToolLM.generated`."""
    return json.dumps([arguments[0], arguments[1]], sort_keys=True, default=str)


def _served_tap():
    from nvfp4tool.export.simulate import served_linear
    from nvfp4tool.model.linear import Plain

    return Plain(served_linear)


def _default_kv():
    from nvfp4tool.model.kv import default_kv

    return default_kv


def _logsumexp(x_NxV: np.ndarray) -> np.ndarray:
    top = np.max(x_NxV, axis=-1, keepdims=True)
    return top + np.log(np.sum(np.exp(x_NxV - top), axis=-1, keepdims=True))


def model_args() -> tuple[str, ...]:
    """The keys `--model_args` accepts (NVFP4ToolLM's keyword arguments but `variant`)."""
    import inspect

    names = inspect.signature(NVFP4ToolLM.__init__).parameters
    return tuple(n for n, p in names.items() if n not in ("self", "variant") and p.kind is p.POSITIONAL_OR_KEYWORD)


def _positive(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise NVFP4UsageError(f"model_args {name}={value}: not an integer") from None
    if number < 1:
        raise NVFP4UsageError(f"model_args {name}={value}: must be >= 1")
    return number


def main() -> None:
    """`python -m nvfp4tool.eval.lm_backend [run] ARGS`: lm-eval's command line with the model
    `nvfp4tool` registered (this module) and the shipped tasks on the include path (unless given)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if "--include_path" not in sys.argv and (len(sys.argv) < 2 or sys.argv[1] not in ("ls", "validate")):
        sys.argv += ["--include_path", TASKS_DIR]
    try:
        cli_evaluate()
    except NVFP4UsageError as exc:  # bad usage: one line, exit 2 (as the nvfp4tool CLI)
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    except NVFP4ToolError as exc:  # bad data: one line, exit 1
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(1) from None


if __name__ == "__main__":  # pragma: no cover
    main()
