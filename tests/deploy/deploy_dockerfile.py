"""A small Dockerfile reader for the deploy tests (no Docker engine needed).

It understands what docker/Dockerfile and docker/Dockerfile.cuda use: stages (``FROM ... AS
name``), line continuations with comment lines inside them, ``ENV k=v ...`` with Docker's
``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${VAR:+alt}`` substitution, ``COPY``
flags, and the JSON (exec) forms of ``ENTRYPOINT``, ``CMD``, ``VOLUME`` and
``HEALTHCHECK ... CMD``. Anything it does not understand raises, so the tests notice a
Dockerfile change instead of misreading it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Copy", "Dockerfile", "Instruction", "Stage", "parse_copy", "parse_env",
           "parse_env_raw", "substitute"]


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: RUN, ENV, ...
    value: str  # the rest of the logical line, continuations joined
    lineno: int  # where it starts (1-based)

    def exec_form(self) -> list[str] | None:
        """The JSON array form of the value, or None for the shell form."""
        if not self.value.lstrip().startswith("["):
            return None
        parsed = json.loads(self.value)
        if not isinstance(parsed, list) or not all(isinstance(p, str) for p in parsed):
            raise ValueError(f"line {self.lineno}: not a JSON array of strings: {self.value}")
        return parsed


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def env(self, initial: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment after this stage's ENV instructions, starting from ``initial``."""
        env = dict(initial or {})
        for ins in self.all("ENV"):
            env.update(parse_env(ins, env))
        return env

    def entrypoint_and_cmd(self) -> list[str]:
        """The process the image starts: ENTRYPOINT followed by CMD (exec forms only)."""
        argv: list[str] = []
        for keyword in ("ENTRYPOINT", "CMD"):
            ins = self.last(keyword)
            if ins is None:
                continue
            form = ins.exec_form()
            if form is None:
                raise ValueError(f"line {ins.lineno}: {keyword} must use the exec (JSON) form")
            argv += form
        return argv

    def healthcheck(self) -> tuple[dict[str, str], list[str]]:
        """HEALTHCHECK's options and its command in exec form."""
        ins = self.last("HEALTHCHECK")
        if ins is None:
            raise ValueError("no HEALTHCHECK")
        m = re.fullmatch(r"((?:--[a-z-]+=\S+\s+)*)CMD\s+(.*)", ins.value.strip(), re.S)
        if m is None:
            raise ValueError(f"line {ins.lineno}: cannot read HEALTHCHECK {ins.value!r}")
        options = dict(o[2:].split("=", 1) for o in m.group(1).split())
        cmd = Instruction("CMD", m.group(2), ins.lineno).exec_form()
        if cmd is None:
            raise ValueError(f"line {ins.lineno}: HEALTHCHECK CMD must use the exec (JSON) form")
        return options, cmd


@dataclass(frozen=True)
class Copy:
    sources: list[str]
    dest: str
    from_stage: str | None
    flags: dict[str, str]


class Dockerfile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.stages: list[Stage] = []
        for ins in _logical_lines(path.read_text()):
            if ins.keyword == "FROM":
                words = [w for w in ins.value.split() if not w.startswith("--")]
                if len(words) == 3 and words[1].upper() == "AS":
                    self.stages.append(Stage(words[0], words[2]))
                elif len(words) == 1:
                    self.stages.append(Stage(words[0], None))
                else:
                    raise ValueError(f"{path}:{ins.lineno}: cannot read FROM {ins.value!r}")
            elif ins.keyword in ("ARG",) and not self.stages:
                continue  # global ARGs before the first FROM
            elif not self.stages:
                raise ValueError(f"{path}:{ins.lineno}: {ins.keyword} before FROM")
            else:
                self.stages[-1].instructions.append(ins)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"{self.path}: no stage named {name!r}")

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def _logical_lines(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = n
        elif not line.strip() or line.lstrip().startswith("#"):
            continue  # blank and comment lines inside a continuation are dropped
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        joined = " ".join(part.strip() for part in buf).strip()
        buf = []
        keyword, _, value = joined.partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), start))
    if buf:
        raise ValueError("the file ends inside a line continuation")
    return out


_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<op>[-+])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def substitute(value: str, env: Mapping[str, str]) -> str:
    """Docker's variable substitution in ENV/WORKDIR/COPY values."""
    def repl(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("bare")
        current = env.get(name, "")
        if m.group("op") == "-":
            return current or m.group("arg")
        if m.group("op") == "+":
            return m.group("arg") if current else ""
        return current

    return _VAR.sub(repl, value)


def parse_env_raw(ins: Instruction) -> list[tuple[str, str]]:
    """The ``(key, value)`` pairs of one ``ENV k=v ...``, before substitution."""
    pairs = []
    for word in shlex.split(ins.value, posix=True):
        key, eq, raw = word.partition("=")
        if not eq:
            raise ValueError(f"line {ins.lineno}: use ENV key=value, not {ins.value!r}")
        pairs.append((key, raw))
    return pairs


def parse_env(ins: Instruction, env: Mapping[str, str]) -> dict[str, str]:
    """The variables one ``ENV k=v ...`` sets; substitution uses the environment before it."""
    return {key: substitute(raw, env) for key, raw in parse_env_raw(ins)}


def parse_copy(ins: Instruction) -> Copy:
    words = ins.exec_form() or shlex.split(ins.value, posix=True)
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        key, _, val = words.pop(0)[2:].partition("=")
        flags[key] = val
    if len(words) < 2:
        raise ValueError(f"line {ins.lineno}: cannot read COPY {ins.value!r}")
    return Copy(words[:-1], words[-1], flags.get("from"), flags)
