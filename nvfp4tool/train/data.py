"""The training data's order: batch `b` is a pure function of (seed, b), so a resume at step s
needs only s. (Documents, tokenizers, the token cache and windows: `nvfp4tool.corpus`.)
Design notes: docs/design/training.md.
"""

from __future__ import annotations

import numpy as np

from nvfp4tool.errors import NVFP4ToolError


def batch_indices(num_windows: int, batch_size: int, seed: int, batch_number: int) -> np.ndarray:
    """The window indices of batch `batch_number` (0-based over the run): a pure function."""
    per_epoch = num_windows // batch_size
    if per_epoch == 0:
        raise NVFP4ToolError(f"batch_size={batch_size} is larger than the {num_windows} training windows")
    epoch, offset = divmod(batch_number, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_windows)
    return order[offset * batch_size : (offset + 1) * batch_size]
