"""Deploy tests: the images, compose files, Kubernetes manifests and Grafana dashboard.

Helpers live in deploy_helpers.py and deploy_dockerfile.py beside this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
