"""Which serving layout a folder claims, as `check` sees it: the folder's `FolderLayout`
(`nvfp4tool.formats`: the one declaration of every layout's tensor names, dtypes, shapes, scale
conventions, config keys and exclusion rules, shared with export but not its code) and the
problems of its JSON configs as check `Problem`s.
"""

from __future__ import annotations

from nvfp4tool.check.report import CONFIG_LEVEL, Problem
from nvfp4tool.formats import CONFIG_FILE, SPECS, FolderLayout, LayoutSpec, describe

CONFIG = CONFIG_FILE
# Every suffix a quantized module of any layout carries besides the plain HF `weight`.
QUANT_SUFFIXES = tuple(dict.fromkeys(s for spec in SPECS.values() for s in spec.suffixes if s != "weight"))
# Suffixes of scale tensors (judged by their own checks, not the generic data scan).
SCALE_SUFFIXES = tuple(dict.fromkeys(t.suffix for spec in SPECS.values() for t in spec.tensors if t.role != "weight"))


def detect_format(folder: str) -> tuple[FolderLayout, list[Problem]]:
    """The folder's layout and the problems of its JSON configs.

    Raises NVFP4ToolError when the folder declares no supported layout at all.
    """
    layout = describe(folder)
    return layout, [Problem(CONFIG_LEVEL, file, message) for file, message in layout.problems]


def input_suffix(spec: LayoutSpec) -> str:
    """The activation-scale suffix of `spec`, or (weight-only) of its W4A4 sibling: the name a
    stray input scale would have."""
    return spec.suffix("input_global") or SPECS[(spec.format, "nvfp4")].suffix("input_global")
