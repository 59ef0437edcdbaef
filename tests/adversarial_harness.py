"""The adversarial harness: one case = one kind of bad input, run in-process, with the safety promises.

Each case builds one kind of bad input (a corrupted tensor, a config that is not JSON, binary data
given as text, an output that would destroy the source, a Hub that never answers...) in a fresh
folder holding copies of the pristine fixtures, runs the command in-process with click's
CliRunner and `run_case` asserts:

* the exit code the contract gives it: 1 for bad data (a file, a tensor), 2 for bad usage;
* exactly one `Error:` line, naming the file / tensor / option (`names`); `also` must appear
  somewhere in the output (e.g. the tensor on `check`'s problem lines);
* no traceback;
* no new, changed or deleted file anywhere under the case's folder, which is also the working
  directory and TMPDIR of the command (so temporary folders left behind are caught too) and
  holds every source: their bytes are hashed before and after.

click >= 8.2 has no `mix_stderr`: `result.output` is stdout and stderr interleaved as a terminal
shows them, which is what the one-`Error:`-line rule is about.

The corpus is `tests/test_adversarial.py` and its friends `tests/test_adversarial_*.py`: each keeps
its own `CASES = []`, `case = registrar(CASES)` and one parametrized test calling `run_case`.
Fixtures (conftest's session-scoped `pristine`, built once, ~20 s): a tiny synthetic BF16 HF model,
its NVFP4 exports in both layouts (made by the CLI), its MaxText checkpoint, calibration ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable

import numpy as np
from click.testing import CliRunner
from hub_server import SilentServer

from nvfp4tool.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_convert import synthetic_config, write_synthetic_hf_folder

CONFIG = synthetic_config(hidden=64, mlp=128, layers=2, vocab=256, head_dim=16, kv_heads=2, dtype="bfloat16")
DOWN = "model.layers.0.mlp.down_proj"
WEIGHTS = "model.safetensors"
SEQ = 32
BINARY = bytes(range(0x80, 0x100)) * 8  # never UTF-8
TEXT = "To be, or not to be, that is the question.\n" * 40


def build_pristine(root) -> dict[str, str]:
    """Read-only originals under `root`; each case works on copies (conftest's session fixture
    `pristine` builds them once)."""
    paths = {
        "hf": str(root / "hf"),
        "ids": str(root / "ids.npy"),
        "mo": str(root / "mo"),
        "ct": str(root / "ct"),
        "mt": str(root / "mt"),
    }
    write_synthetic_hf_folder(paths["hf"], CONFIG, seed=3)
    np.save(paths["ids"], np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, SEQ)))
    runner = CliRunner()
    for key, fmt in (("mo", "modelopt"), ("ct", "compressed-tensors")):
        result = runner.invoke(
            cli,
            [
                "-q",
                "export",
                paths["hf"],
                "--out",
                paths[key],
                "--format",
                fmt,
                "--calib-data",
                paths["ids"],
                "--calib-samples",
                "4",
                "--calib-seq-len",
                str(SEQ),
            ],
        )
        assert result.exit_code == 0, result.output
    result = runner.invoke(
        cli,
        [
            "-q",
            "convert",
            paths["hf"],
            paths["mt"],
            "--to",
            "maxtext",
            "--model-config",
            paths["hf"],
            "--rope-layout",
            "half",
        ],
    )
    assert result.exit_code == 0, result.output
    return paths


class World:
    """One case's folder: copies of the fixtures on demand, files to write, paths to name."""

    def __init__(self, root: str, pristine: dict[str, str]) -> None:
        self.root, self._pristine = root, pristine

    def copy(self, key: str, as_name: str | None = None) -> str:
        target = os.path.join(self.root, as_name or key)
        if not os.path.exists(target):
            source = self._pristine[key]
            (shutil.copytree if os.path.isdir(source) else shutil.copyfile)(source, target)
        return target

    def file(self, name: str, content: bytes | str) -> str:
        path = self.path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
        return path

    def folder(self, name: str) -> str:
        path = self.path(name)
        os.makedirs(path, exist_ok=True)
        return path

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)


# ---------------------------------------------------------------------------------------- file surgery


def read_st(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(path: str, header: dict, data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def edit_header(path: str, change: Callable[[dict], None]) -> None:
    """Change the header (dtypes, shapes, offsets); the data bytes stay as they are."""
    header, data = read_st(path)
    change(header)
    write_st(path, header, data)


def drop_tensor(path: str, name: str) -> None:
    """Rewrite the file without `name` (offsets kept contiguous)."""
    header, data = read_st(path)
    entries = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    new_header, chunks, at = ({"__metadata__": header["__metadata__"]} if "__metadata__" in header else {}), [], 0
    for _, key in entries:
        if key == name:
            continue
        begin, end = header[key]["data_offsets"]
        chunks.append(data[begin:end])
        new_header[key] = {**header[key], "data_offsets": [at, at + end - begin]}
        at += end - begin
    write_st(path, new_header, b"".join(chunks))


def poke(path: str, tensor: str, new: Callable[[bytes], bytes], *, index: int = 0, size: int | None = None) -> None:
    """Replace bytes [index, index + size) of `tensor`'s data with new(old)."""
    header, data = read_st(path)
    begin, end = header[tensor]["data_offsets"]
    size = end - begin - index if size is None else size
    start = begin + index
    data = data[:start] + new(data[start : start + size]) + data[start + size :]
    write_st(path, header, data)


def set_f32(path: str, tensor: str, change: Callable[[float], float]) -> None:
    poke(path, tensor, lambda old: np.float32(change(float(np.frombuffer(old, "<f4")[0]))).tobytes(), size=4)


BF16_NAN, BF16_INF = b"\xc0\x7f", b"\x80\x7f"


def edit_json(path: str, change: Callable[[dict], None]) -> None:
    with open(path) as f:
        obj = json.load(f)
    change(obj)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def truncate(path: str, keep: float | int) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep) if isinstance(keep, float) else size - keep)


def largest_chunk(checkpoint: str) -> str:
    chunks = [os.path.join(d, n) for d, _, names in os.walk(checkpoint) for n in names if os.path.basename(d) == "d"]
    return max(chunks, key=os.path.getsize)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    code: int  # 1 bad data, 2 bad usage
    build: Callable[[World], tuple[list[str], tuple[str, ...]]]  # -> argv, fragments of the Error line
    also: tuple[str, ...] = ()  # fragments anywhere in the output
    hub: bool = False  # HF_TOKEN set and the Hub client kept local


def registrar(cases: list[Case]):
    """`case = registrar(CASES)`; then `@case("command/what-is-wrong", code)` over a builder
    `(World) -> (argv, fragments of the Error line)` appends one Case to `cases`."""

    def case(id: str, code: int, *, also: tuple[str, ...] = (), hub: bool = False):
        def register(build):
            cases.append(Case(id, code, build, also, hub))
            return build

        return register

    return case


def _snapshot(root: str) -> dict[str, str]:
    """Relative path -> sha256 of every file (and "dir" for every folder, "link" for links)."""
    found = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                found[rel] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                found[rel] = "dir"
            else:
                with open(path, "rb") as f:
                    found[rel] = hashlib.sha256(f.read()).hexdigest()
    return found


TOKEN = "hf_adversarialTOKEN-must-not-print-51d2"


def run_case(case: Case, pristine: dict[str, str], tmp_path, monkeypatch) -> None:
    """Run one case in a fresh World under `tmp_path` and assert the safety promises (module
    docstring); conftest's `hub_env` fixture must be active."""
    if not case.hub:
        monkeypatch.delenv("HF_TOKEN")
    world = World(str(tmp_path / "w"), pristine)
    os.makedirs(world.path("tmp"))
    argv, names = case.build(world)
    monkeypatch.chdir(world.root)
    monkeypatch.setenv("TMPDIR", world.path("tmp"))
    monkeypatch.setattr(tempfile, "tempdir", world.path("tmp"))
    before = _snapshot(world.root)
    with SilentServer(lifetime=30) as silent:
        argv = [a.replace("{silent}", silent.url) for a in argv]
        names = tuple(n.replace("{silent}", silent.url) for n in names)
        result = CliRunner().invoke(cli, argv)
    output = result.output
    assert result.exit_code == case.code, f"exit {result.exit_code}, expected {case.code}:\n{output}"
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    for fragment in names:
        assert fragment in errors[0], f"{fragment!r} not named in: {errors[0]}"
    for fragment in case.also:
        assert fragment in output, f"{fragment!r} not in the output:\n{output}"
    assert "Traceback" not in output and "internal error" not in output, output
    assert TOKEN not in output
    after = _snapshot(world.root)
    assert {k for k in after if k not in before} == set(), "new files"
    assert {k for k in before if k not in after} == set(), "deleted files"
    assert {k for k in before if before[k] != after[k]} == set(), "changed files"
