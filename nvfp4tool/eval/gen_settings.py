"""Generation settings (lm-eval's gen_kwargs) typed and checked in one place: eval's --gen-kwargs
(`parse`), a task's generation_kwargs and lm-eval's own requests (`check`), and every true/false
setting, the lm-eval backend's model_args included (`boolean`). A value of the wrong type or out of
range is a usage error naming where it came from, the key and the rule.
Design notes: docs/design/eval.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nvfp4tool.errors import NVFP4UsageError

BOOLEANS = {"true": True, "1": True, "false": False, "0": False}

# key -> (integer?, lowest, lowest allowed?, highest or None, why the bound)
NUMBERS: dict[str, tuple[bool, float, bool, float | None, str]] = {
    "max_gen_toks": (True, 1, True, None, ""),
    "max_new_tokens": (True, 1, True, None, ""),
    "max_tokens": (True, 1, True, None, ""),
    "max_completion_tokens": (True, 1, True, None, ""),
    "top_k": (True, 0, True, None, " (0 keeps every token)"),
    "num_beams": (True, 1, True, None, ""),
    "temperature": (False, 0.0, True, None, " (0 decodes greedily)"),
    "top_p": (False, 0.0, False, 1.0, ""),
    "typical_p": (False, 0.0, False, 1.0, ""),
    "repetition_penalty": (False, 0.0, False, None, ""),
}
FLAGS = ("do_sample",)


def boolean(value: Any, what: str) -> bool:
    """`value` as a bool: True / False, or the text true / false / 1 / 0 (any case); else refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in BOOLEANS:
        return BOOLEANS[text]
    raise NVFP4UsageError(f"{what}={value}: not a boolean (true, false, 1 or 0)")


def integer(value: Any, what: str) -> int:
    """`value` as an int (an int, a whole float or its text); a bool or anything else refused."""
    if isinstance(value, bool):
        raise NVFP4UsageError(f"{what}={value}: not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return int(str(value).strip())
    except ValueError:
        raise NVFP4UsageError(f"{what}={value}: not an integer") from None


def number(value: Any, what: str) -> float:
    """`value` as a finite float (a number or its text); a bool, nan, inf or anything else refused."""
    if isinstance(value, bool):
        raise NVFP4UsageError(f"{what}={value}: not a number")
    try:
        result = float(value if isinstance(value, (int, float)) else str(value).strip())
    except ValueError:
        raise NVFP4UsageError(f"{what}={value}: not a number") from None
    if not math.isfinite(result):
        raise NVFP4UsageError(f"{what}={value}: not a finite number")
    return result


def check(kwargs: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """A typed copy of generation settings: flags as bools, counts as ints, the rest as finite
    floats in their ranges, `until` as text or a list of texts; other keys pass unchanged (the
    backend's `decoding` refuses what it does not implement)."""
    typed: dict[str, Any] = {}
    for key, value in kwargs.items():
        what = f"{origin} {key}"
        if key in FLAGS:
            typed[key] = boolean(value, what)
        elif key in NUMBERS:
            whole, low, low_ok, high, why = NUMBERS[key]
            typed[key] = integer(value, what) if whole else number(value, what)
            if typed[key] < low or (typed[key] == low and not low_ok):
                raise NVFP4UsageError(f"{what}={value}: must be {'>=' if low_ok else '>'} {low:g}{why}")
            if high is not None and typed[key] > high:
                raise NVFP4UsageError(f"{what}={value}: must be <= {high:g}")
        elif key == "until":
            if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))):
                raise NVFP4UsageError(f"{what}={value!r}: expected a stop string or a list of them")
            typed[key] = value
        else:
            typed[key] = value
    return typed


def parse(text: str, origin: str = "--gen-kwargs") -> dict[str, Any]:
    """ "KEY=VALUE,KEY=VALUE" (lm-eval's spelling) as checked, typed settings."""
    pairs = [p for p in text.split(",") if p.strip()]
    if not pairs or any("=" not in p or not p.split("=", 1)[0].strip() for p in pairs):
        raise NVFP4UsageError(f"{origin} {text!r}: expected KEY=VALUE[,KEY=VALUE...]")
    raw: dict[str, str] = {}
    for pair in pairs:
        key, value = (part.strip() for part in pair.split("=", 1))
        if key in raw:
            raise NVFP4UsageError(f"{origin} {text!r}: {key} is given twice")
        raw[key] = value
    return check(raw, origin)
