"""How a record names a local thing it may publish: its Hub repo id, else its base name.

    portable_name("/c/hub/models--meta-llama--Llama-3.2-1B/snapshots/ab12")  # "meta-llama/Llama-3.2-1B"
    portable_name("/data/runs/llama-local/")                                 # "llama-local"
    source_repo_id("/data/llama-local")                                       # None

Records (the export provenance, the validation record) and the model card use these, so nothing
`push` uploads names an absolute path of the user's machine.
"""

from __future__ import annotations

import os
import re

_HF_CACHE_REPO = re.compile(r"models--(?P<org>[^/\\]+?)--(?P<name>[^/\\]+?)(?:[/\\]|$)")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def source_repo_id(path: str) -> str | None:
    """The Hub repo id a path names: a Hub cache snapshot (`.../models--org--name/...`) or a bare
    `org/name` that is not a local folder; None for other local paths."""
    cached = _HF_CACHE_REPO.search(path)
    if cached:
        return f"{cached['org']}/{cached['name']}"
    if _REPO_ID.match(path) and not os.path.exists(path):
        return path
    return None


def portable_name(path: str) -> str:
    """A name for `path` that may be published: its Hub repo id, else its base name."""
    return source_repo_id(path) or os.path.basename(os.path.abspath(path).rstrip(os.sep))
