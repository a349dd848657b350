"""The MLPs of bench/batching.py, shared with the baseline app (bench/_baseline_app.py),
so both serve the same weights."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

# Two MLPs: a small one, where the API process's per-call work is the bound, and a
# larger one (24 MiB of weights), where the device's per-run work is.
SIZES = {"small": (256, 512, 10), "large": (1024, 2048, 16)}


def make_mlp(size: str) -> Any:
    n_in, hidden, n_out = SIZES[size]
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((n_in, hidden)) / np.sqrt(n_in)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    w3 = (rng.standard_normal((hidden, n_out)) / np.sqrt(hidden)).astype(np.float32)

    def mlp(x):  # noqa: ANN001, ANN202
        h = jax.nn.relu(x @ w1)
        h = jax.nn.relu(h @ w2)
        return jax.nn.softmax(h @ w3, axis=-1)

    return mlp
