"""The import graph of `nvfp4tool/` and `converters/`: no cycle between modules, and no import from
a lower layer to a higher one.

The graph is read with the stdlib `ast`, never by importing: every `import` and `from ... import`
anywhere in a module counts (module level, inside functions, under `if TYPE_CHECKING:`), relative
imports resolved; an edge goes to the deepest module the statement names (`from pkg import mod`
is an edge to `pkg.mod`; `from pkg.mod import name` to `pkg.mod`).

Layers, lowest first (`LAYERS`). Each module sits in the layer of the longest entry that prefixes
its dotted name, and a module may import only modules of its own layer or of lower ones. The
order follows the data flow (checkpoint in -> model -> train -> quantize -> export -> validate ->
eval -> publish) with the shared leaves at the bottom and the CLI at the top:

    nvfp4tool            the package root (`__version__`) and `errors`: imported by everything
    progress, tables     the one output interface and its tables printed whole
    memory               available memory and the offload decision
    numerics             all NVFP4/FP8 math
    records              the typed files stages hand each other (base reader, export, validation, evaluation)
    families, config     the model families (their facts, the module table) and ModelConfig (HF config.json)
    converters           the checkpoint formats: HF safetensors and MaxText readers/writers, the
                         name/layout table, atomic output folders (a top-level package)
    formats              the serving layouts (LayoutSpec), declared once
    corpus               training data: documents, tokenizers, the token cache, packing, batches
    model                the Flax model, running it layer by layer, its sharding on a device mesh
    recipes              the BF16/FP8/NVFP4 training GEMMs and the precision map
    run                  a training run's files: its TrainConfig and its records (run.json, ...)
    checkpoints          the one checkpoint opener (HF folder, MaxText checkpoint, training run)
    convert              the `convert` stage (checkpoint in -> checkpoint out)
    train                the trainer, its loss, data, tokenizer, checkpoints and metrics
    check                the checker of serving folders (export and convert-format run it)
    export               quantization, calibration, GPTQ, the writers, the serving simulation
    validate             validation runs, thresholds, reports, the files a validation hashes
    eval                 task evaluation: the lm-eval model over validate's openers, the paired
                         statistics, eval's reports, the shipped offline tasks
    hub                  the model card, the chain of custody push enforces, upload
    quickstart           the one-command tour
    api, cli             one function per command (the Python API), then the click wiring over it

The exemption list is empty and stays empty: an edge that breaks the order is fixed by moving
code, not by listing it here.

A second graph, of what runs at import time (`import_time_edges`): the imports a module executes
when it is imported (module and class level, not in functions, not under `if TYPE_CHECKING:`),
where `from pkg import name` reads `pkg`'s namespace and so is an edge to the package `pkg` itself
(its `__init__`), besides one to `pkg.name` when that is a module. A cycle there is a package whose
`__init__` imports a submodule that imports back through the package (`nvfp4tool.export` ->
`export.job` -> `from nvfp4tool.export import provenance`): it works or fails by import order. A
submodule imports its siblings directly (`from nvfp4tool.export.provenance import ...`).
"""

from __future__ import annotations

import ast
import functools
import pathlib

from fixtures import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)
PACKAGES = ("nvfp4tool", "converters")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("nvfp4tool", "nvfp4tool.errors"),
    ("nvfp4tool.progress", "nvfp4tool.tables"),
    ("nvfp4tool.memory",),
    ("nvfp4tool.numerics",),
    ("nvfp4tool.records",),
    ("nvfp4tool.families", "nvfp4tool.config"),
    ("converters",),
    ("nvfp4tool.formats",),
    ("nvfp4tool.corpus",),
    ("nvfp4tool.model",),
    ("nvfp4tool.recipes",),
    ("nvfp4tool.run",),
    ("nvfp4tool.checkpoints",),
    ("nvfp4tool.convert",),
    ("nvfp4tool.train",),
    ("nvfp4tool.check",),
    ("nvfp4tool.export",),
    ("nvfp4tool.validate",),
    ("nvfp4tool.eval",),
    ("nvfp4tool.hub",),
    ("nvfp4tool.quickstart",),
    ("nvfp4tool.api",),
    ("nvfp4tool.cli",),
)
EXEMPT: frozenset[tuple[str, str]] = frozenset()  # (importer, imported): must stay empty


def modules(root: pathlib.Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the packages under `root`."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_edges(mods: dict[str, pathlib.Path], root: pathlib.Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> ["file:line", ...] for every import between our modules."""
    return _edges(mods, root, import_time=False)


def import_time_edges(mods: dict[str, pathlib.Path], root: pathlib.Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> ["file:line", ...] for every import a module runs when it is imported,
    an import through a package (`from pkg import name`) being an edge to the package too."""
    return _edges(mods, root, import_time=True)


def _executed(body: list[ast.stmt]):
    """The statements a module runs when imported: not function bodies nor `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _executed(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _executed([n for n in getattr(node, field, []) if isinstance(n, ast.stmt)])
        for handler in getattr(node, "handlers", []):
            yield from _executed(handler.body)


def _edges(mods: dict[str, pathlib.Path], root: pathlib.Path, import_time: bool) -> dict[tuple[str, str], list[str]]:
    """The import graph of `mods`: every import in a file (`import_time` False: `from pkg import mod`
    an edge to pkg.mod only), or those run at import time (True: an edge to pkg too)."""

    def deepest(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _executed(tree.body) if import_time else ast.walk(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [deepest(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                named = [f"{source}.{alias.name}" for alias in node.names]
                if import_time:
                    targets = [deepest(source)] + [m for m in named if m in mods]
                else:
                    targets = [m if m in mods else deepest(source) for m in named]
            for target in targets:
                if target is not None and target != name:
                    where, at = edges.setdefault((name, target), []), f"{path.relative_to(root)}:{node.lineno}"
                    if at not in where:
                        where.append(at)
    return edges


@functools.cache
def _tree_edges() -> dict[tuple[str, str], list[str]]:
    return import_edges(modules())


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = index, len(entry)
    return best


def upward(edges) -> list[tuple[str, str]]:
    """The edges from a lower layer to a higher one."""
    return sorted(
        (a, b)
        for a, b in edges
        if (a, b) not in EXEMPT and layer_of(a) is not None and layer_of(b) is not None and layer_of(a) < layer_of(b)
    )


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _show(edges, pairs) -> str:
    return "\n".join(f"  {a} -> {b}  ({', '.join(edges[(a, b)])})" for a, b in sorted(pairs))


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add their package to LAYERS): {unplaced}"


def test_no_import_cycle():
    edges = _tree_edges()
    found = cycles(set(edges) - EXEMPT)
    report = "\n".join(
        f"cycle {' <-> '.join(c)}:\n" + _show(edges, [e for e in edges if e[0] in c and e[1] in c]) for c in found
    )
    assert not found, f"{len(found)} import cycle(s):\n{report}"


def test_no_import_time_cycle_through_a_package():
    """What runs at import time has no cycle: no package's `__init__` imports a module that imports
    back through the package (see the module docstring)."""
    edges = import_time_edges(modules())
    found = cycles(set(edges))
    report = "\n".join(
        f"cycle {' <-> '.join(c)}:\n" + _show(edges, [e for e in edges if e[0] in c and e[1] in c]) for c in found
    )
    assert not found, f"{len(found)} import-time cycle(s):\n{report}"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    edges = _tree_edges()
    found = upward(edges)
    assert not found, f"{len(found)} upward import(s) (lower layer -> higher layer):\n{_show(edges, found)}"


def test_exemptions_stay_empty():
    assert not EXEMPT


def test_one_name_per_dtype_constant():
    """A module-level constant whose name says DTYPE is defined in one module only: a second one
    either repeats a fact another module owns (import it) or means something else (name it by use)."""
    defined: dict[str, list[str]] = {}
    for name, path in modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = (
                [t for t in node.targets if isinstance(t, ast.Name)]
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                else []
            )
            for target in targets:
                if "DTYPE" in target.id.upper() and target.id.lstrip("_").isupper():
                    defined.setdefault(target.id, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    repeated = {k: v for k, v in defined.items() if len(v) > 1}
    assert not repeated, f"dtype constants defined more than once: {repeated}"


def test_the_checker_sees_a_planted_cycle_and_an_upward_import(tmp_path):
    """The checker itself, on a made-up tree: a function-level import, one under TYPE_CHECKING and
    a relative one are all edges; the cycle they close and the upward edge are both reported."""
    package = tmp_path / "nvfp4tool"
    (package / "model").mkdir(parents=True)
    (package / "train").mkdir()
    for init in (package, package / "model", package / "train"):
        (init / "__init__.py").write_text("")
    (package / "model" / "weights.py").write_text("def f():\n    from nvfp4tool.train import trainer\n")
    (package / "train" / "trainer.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import step\n"
    )
    (package / "train" / "step.py").write_text("from ..model.weights import f\n")
    edges = import_edges(modules(tmp_path, ("nvfp4tool",)), tmp_path)
    assert set(edges) == {
        ("nvfp4tool.model.weights", "nvfp4tool.train.trainer"),
        ("nvfp4tool.train.trainer", "nvfp4tool.train.step"),
        ("nvfp4tool.train.step", "nvfp4tool.model.weights"),
    }
    assert edges[("nvfp4tool.model.weights", "nvfp4tool.train.trainer")] == [
        str(pathlib.Path("nvfp4tool", "model", "weights.py")) + ":2"
    ]
    assert cycles(edges) == [["nvfp4tool.model.weights", "nvfp4tool.train.step", "nvfp4tool.train.trainer"]]
    assert upward(edges) == [("nvfp4tool.model.weights", "nvfp4tool.train.trainer")]
    assert layer_of("nvfp4tool.errors") == layer_of("nvfp4tool") == 0
    assert layer_of("converters.hf") < layer_of("nvfp4tool.checkpoints") < layer_of("nvfp4tool.train.trainer")


def test_the_import_time_checker_sees_a_cycle_through_a_package(tmp_path):
    """On a made-up tree: a package whose `__init__` imports a submodule that imports a sibling
    through the package is a cycle; the same sibling imported directly, or inside a function, or
    under TYPE_CHECKING is not."""
    package = tmp_path / "nvfp4tool" / "export"
    package.mkdir(parents=True)
    (tmp_path / "nvfp4tool" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from nvfp4tool.export.job import run\n")
    (package / "provenance.py").write_text("def record():\n    pass\n")
    (package / "job.py").write_text("from nvfp4tool.export import provenance\n")
    mods = modules(tmp_path, ("nvfp4tool",))
    edges = import_time_edges(mods, tmp_path)
    assert ("nvfp4tool.export.job", "nvfp4tool.export") in edges
    assert cycles(edges) == [["nvfp4tool.export", "nvfp4tool.export.job"]]
    assert cycles(import_edges(mods, tmp_path)) == []  # the whole-file graph names the module, not the package
    for fixed in (
        "from nvfp4tool.export.provenance import record\n",
        "def f():\n    from nvfp4tool.export import provenance\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nvfp4tool.export import provenance\n",
    ):
        (package / "job.py").write_text(fixed)
        assert cycles(import_time_edges(mods, tmp_path)) == [], fixed


def test_the_model_names_a_family_only_in_its_blocks_modules():
    """Only a family's blocks module (`Family.blocks_module`), and the modules only blocks modules
    import (the Mamba mixer), import a family group's module (`families.llama`, `families.moe`,
    `families.nemotron_h`) or a blocks module: the generic model (transformer, generate,
    layerwise, ...) builds every family's model without naming one."""
    from nvfp4tool.families import REGISTRY

    edges = _tree_edges()
    groups = {type(family).__module__ for family in REGISTRY.values()}
    blocks = {family.blocks_module for family in REGISTRY.values()}
    assert groups >= {"nvfp4tool.families.llama", "nvfp4tool.families.moe", "nvfp4tool.families.nemotron_h"}
    assert blocks <= set(modules())
    model = [m for m in modules() if m.startswith("nvfp4tool.model.")]
    importers = {m: {a for a, b in edges if b == m and a.startswith("nvfp4tool.")} for m in model}
    owned = blocks | {m for m in model if importers[m] and importers[m] <= blocks}
    found = sorted((a, b) for a, b in edges if a in model and a not in owned and (b in groups or b in blocks))
    assert not found, f"model modules naming a family outside its blocks modules:\n{_show(edges, found)}"
