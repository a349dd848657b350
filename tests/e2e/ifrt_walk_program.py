"""An unmodified JAX program at random, for ``test_ifrt_walk_e2e``: run with
``JAX_PLATFORMS=jitserve`` and a seed, it puts arrays, runs jitted and eager
computations on them, donates, reads and drops them, and checks every value it
reads against numpy's. It waits for a line on stdin before each step (``go``), so
that its driver can kill runtimes between steps (or, ``spin``, run a program that
never ends, past the server's deadline), and prints one JSON line per step: what
it did, whether a value it read was right, and, if it raised, the exception's
message (the driver judges it). ``end`` makes it read every array still alive and
say how many were wrong and how many raised.
"""

from __future__ import annotations

import json
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal up to float32 rounding in another order (XLA sums 512 rows otherwise than
    numpy: an element near zero of a sum of values near 20 differs by 1e-5): within
    1e-4 of the array's largest magnitude. Another array's data, or none, is far off."""
    scale = 1.0 + float(np.abs(want).max(initial=0.0))
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-4, atol=1e-4 * scale))


def main(seed: int) -> None:
    rng = random.Random(seed)
    data = np.random.default_rng(seed)
    live: dict[int, tuple[jax.Array, np.ndarray]] = {}  # name -> (array, its value)
    counter = iter(range(1 << 30))
    scale = jax.jit(lambda a, k: a * k)
    add = jax.jit(lambda a, b: a + b)
    bump = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    reduce = jax.jit(lambda a: (a.sum(axis=0), a.max()))
    # Never ends: the server's execution deadline stops it (and its session).
    spin = jax.jit(lambda x: jax.lax.while_loop(lambda c: c.sum() >= 0, lambda c: c + 1.0, x))

    def new(array: jax.Array, value: np.ndarray) -> None:
        live[next(counter)] = (array, value)

    def pick(n: int = 1, ndim: int | None = None) -> list[int]:
        """``n`` live arrays at random (of rank ``ndim``); raises ``LookupError`` if too few."""
        names = sorted(k for k, (_, v) in live.items() if ndim is None or v.ndim == ndim)
        if len(names) < n:
            raise LookupError
        return rng.sample(names, n)

    for line in sys.stdin:
        command = line.strip()
        if command == "end":
            break
        op = "spin" if command == "spin" else rng.choice([
            "put", "put", "put_big", "scale", "add", "bump", "reduce", "eager", "read", "read",
            "drop"])
        used: list[int] = []
        step: dict[str, object] = {"op": op}
        try:
            if op == "spin":
                spin(jnp.ones(3)).block_until_ready()
            elif op == "put" or (op != "put_big" and not live):
                value = data.standard_normal((rng.randint(1, 64), 8)).astype(np.float32)
                new(jax.device_put(value), value)
            elif op == "put_big":  # over a MiB: through the host buffer store in chunks
                value = data.standard_normal((512, 1024)).astype(np.float32)
                new(jax.device_put(value), value)
            elif op == "scale":
                used = pick()
                array, value = live[used[0]]
                k = np.float32(rng.choice([0.5, 2.0, -1.0]))
                new(scale(array, k), value * k)
            elif op == "add":
                used = pick(2)
                (a, va), (b, vb) = live[used[0]], live[used[1]]
                if va.shape == vb.shape:
                    new(add(a, b), va + vb)
            elif op == "bump":  # donated: the input is gone after the call, as in jax
                used = pick()
                array, value = live.pop(used[0])
                new(bump(array), value + 1)
            elif op == "reduce":
                used = pick(ndim=2)
                array, value = live[used[0]]
                total, top = reduce(array)
                new(total, value.sum(axis=0))
                new(top, value.max())
            elif op == "eager":
                used = pick()
                array, value = live[used[0]]
                new(jnp.tanh(array) * 3, np.tanh(value) * 3)
            elif op == "read":
                used = pick()
                array, value = live[used[0]]
                got = np.asarray(array)
                step["read"] = _close(got, value)
                if not step["read"]:  # what differs, for the driver's message
                    step["got"] = np.asarray(got, np.float64).ravel()[:4].tolist()
                    step["want"] = np.asarray(value, np.float64).ravel()[:4].tolist()
                    step["shape"] = list(value.shape)
            elif op == "drop":
                used = pick()
                live.pop(used[0])
        except LookupError:  # too few arrays for it: nothing done
            step["op"] = "none"
        except Exception as e:  # noqa: BLE001 - the driver judges each message
            step["error"] = f"{type(e).__name__}: {e}"[:2000]
            for k in used:  # as jax does: a failed array stays failed
                live.pop(k, None)
        print(json.dumps(step), flush=True)
    # Every array still alive is read, so that none is left unchecked.
    wrong, errors = [], []
    for k, (array, value) in sorted(live.items()):
        try:
            if not _close(np.asarray(array), value):
                wrong.append(k)
        except Exception as e:  # noqa: BLE001 - the driver judges each message
            errors.append(f"{type(e).__name__}: {e}"[:2000])
    print(json.dumps({"end": True, "live": len(live), "wrong": wrong, "errors": errors}),
          flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
