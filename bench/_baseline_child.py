"""The supervised baseline's child (bench/_baseline_app.py, ``/run_child``).

Reads requests from stdin and writes answers to stdout, one at a time, each
framed as a 4-byte big-endian length and the bytes: a request is one byte (``j``
for a JSON body, ``m`` for msgpack) and the HTTP body; an answer is the HTTP body
to send back. It decodes, runs the jitted function and encodes, exactly as the
in-process baseline does, so the two differ by the pipe round trip alone.
"""

from __future__ import annotations

import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _baseline_app import answer, f  # noqa: E402

jax.config.update("jax_enable_x64", True)


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while head := stdin.read(4):
        frame = stdin.read(int.from_bytes(head, "big"))
        out = answer(f, frame[1:], as_json=frame[:1] == b"j")
        stdout.write(len(out).to_bytes(4, "big") + out)
        stdout.flush()


if __name__ == "__main__":
    main()
