"""Which JAX primitives the jaxpr format carries, measured on the test corpus.

For every primitive that ``jax.extend.core.primitives`` exports (and the few
extra ones the decoder allows), prints one of:

- ``round trip``: in the corpus; every case using it encoded (JSON and msgpack),
  decoded, and gave results identical to ``jax.jit`` of the original function;
- ``allowlisted``: the decoder accepts it, but no corpus case reaches it;
- ``refused``: the decoder refuses it, with the reason;
- ``FAILED``: a corpus case using it failed (a bug).

Usage::

    python bench/jaxpr_coverage.py              # a text table and a summary
    python bench/jaxpr_coverage.py --markdown   # the table for docs/jaxpr-format.md
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "compiler")]


@dataclasses.dataclass
class Usage:
    """What the corpus did with one primitive."""

    cases: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)


def _primitives_in(jaxpr: Any) -> Iterator[str]:
    from jax.extend import core

    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in core.jaxprs_in_params(eqn.params):
            yield from _primitives_in(sub)


def _run_case(case: Any) -> tuple[set[str], str | None]:
    """The primitives a case uses, and why its round trip failed (None if it did not)."""
    import jax
    import numpy as np
    from jaxpr_cases import case_args

    from jitserve.client.jaxpr import encode_jaxpr, trace_flat
    from jitserve.compiler.jaxpr import decode_document

    args = case_args(case)
    closed, _, _ = trace_flat(case.fn, *args)
    prims = set(_primitives_in(closed.jaxpr))
    try:
        decoded = [decode_document(encode_jaxpr(closed, format=f)) for f in ("json", "msgpack")]
        got = jax.jit(decoded[1].as_function(), keep_unused=True)(*jax.tree.leaves(args))
        want = jax.tree.leaves(jax.jit(case.fn)(*args))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if not np.array_equal(np.asarray(g), np.asarray(w), equal_nan=True):
                return prims, f"output {i} differs from jax.jit"
    except Exception as e:  # noqa: BLE001 - a report, not a library
        return prims, f"{type(e).__name__}: {str(e)[:200]}"
    return prims, None


def measure() -> dict[str, Usage]:
    """Runs the corpus; returns the usage of each primitive."""
    import jax
    from jaxpr_cases import all_cases

    jax.config.update("jax_enable_x64", True)
    usage: dict[str, Usage] = collections.defaultdict(Usage)
    for case in all_cases():
        prims, failure = _run_case(case)
        for name in prims:
            usage[name].cases.append(case.name)
            if failure:
                usage[name].failures.append(f"{case.name}: {failure}")
    return usage


def table(usage: dict[str, Usage]) -> list[tuple[str, str, str]]:
    """``(primitive, status, detail)`` rows: public primitives, then the extra allowed ones."""
    from jitserve.compiler.jaxpr._prims import REFUSED, SPECS, public_primitives

    public = sorted(public_primitives())
    extra = sorted(set(SPECS) - set(public))
    rows = []
    for name in public + extra:
        where = "" if name in public else " (not in jax.extend)"
        use = usage.get(name)
        if name in REFUSED:
            rows.append((name, "refused", REFUSED[name]))
        elif name not in SPECS:
            rows.append((name, "MISSING", "neither allowed nor refused"))
        elif use and use.failures:
            rows.append((name, "FAILED", use.failures[0]))
        elif use:
            rows.append((name, "round trip", f"{len(use.cases)} case(s){where}"))
        else:
            rows.append((name, "allowlisted", f"not reached by the corpus{where}"))
    return rows


def summary(rows: list[tuple[str, str, str]]) -> str:
    from jitserve.compiler.jaxpr._prims import public_primitives

    public = set(public_primitives())
    count = collections.Counter(status for name, status, _ in rows if name in public)
    extra = sum(1 for name, status, _ in rows if name not in public and status == "round trip")
    allowed = count["round trip"] + count["allowlisted"]
    return (f"{len(public)} public primitives: {allowed} encode and decode "
            f"({count['round trip']} round-tripped by the corpus with identical numerics, "
            f"{count['allowlisted']} allowlisted but not reached), {count['refused']} refused, "
            f"{count['FAILED']} failed, {count['MISSING']} missing; "
            f"plus {extra} primitives outside jax.extend round-tripped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    rows = table(measure())
    if args.markdown:
        print("| primitive | status | detail |\n|---|---|---|")
        print("\n".join(f"| `{n}` | {s} | {d} |" for n, s, d in rows))
    else:
        width = max(len(n) for n, _, _ in rows)
        print("\n".join(f"{n:<{width}}  {s:<11}  {d}" for n, s, d in rows))
    print(f"\n{summary(rows)}")
    return 1 if any(s in ("FAILED", "MISSING") for _, s, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
