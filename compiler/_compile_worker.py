"""Entry point of a compile worker process: ``python -m compiler._compile_worker R W``.

Kept apart from ``compiler._worker`` so that running it does not re-execute a
module the package has already imported.
"""

from __future__ import annotations

import sys

from jitserve.compiler._worker import Pipe, _worker_main

if __name__ == "__main__":
    _worker_main(Pipe(int(sys.argv[1]), int(sys.argv[2])))
