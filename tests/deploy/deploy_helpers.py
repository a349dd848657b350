"""Shared helpers of the deploy tests: the repository root and the checker tools.

The checkers come from the [test] extra; a missing one fails the test with the install
command, so CI never passes by skipping them.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL_HINT = "install the test extra: .venv/bin/pip install -e '.[test]'"


def tool(name: str, hint: str = INSTALL_HINT) -> str:
    """The path of an executable (the venv's bin first, then PATH), or fail with ``hint``."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: {hint}", pytrace=False)
    return found


def module(name: str) -> ModuleType:
    """Import a checker library, or fail saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.fail(f"cannot import {name} ({e}): {INSTALL_HINT}", pytrace=False)


def run(cmd: list[str], timeout: float = 120, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run a checker with captured output; the caller looks at the exit status."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          **kwargs)  # type: ignore[call-overload]


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                "and", "or", "unless", "inf", "nan"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses."""
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)
    labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", " ".join(
        re.findall(r"\{([^}]*)\}", s))))
    s = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", s)  # label matchers and range selectors
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # dashboard variables
    for m in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", s):
        labels.update(w.strip() for w in m.group(1).split(",") if w.strip())
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" \1 ", s)
    s = re.sub(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?(?![\w.])", " ", s)
    metrics = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        rest = s[m.end():].lstrip()
        if rest.startswith("(") or re.match(r"(by|without)\b", rest) \
                or m.group(0) in PROMQL_WORDS:
            continue  # a function, an aggregation (sum by (...) (...)) or a keyword
        metrics.add(m.group(0))
    return metrics, labels
