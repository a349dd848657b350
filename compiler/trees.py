"""Pytree structures as JSON, so callers without jax can read them.

``null`` is a leaf; ``{"tuple": [...]}``, ``{"list": [...]}``, ``{"dict": {k: ...}}``
and ``{"none": true}`` are containers (docs/api.md). Custom pytree nodes are named
``{"node": "<type name>", "children": [...]}`` for information only.
"""

from __future__ import annotations

from typing import Any

from jax import tree_util

__all__ = ["treedef_to_json"]


def treedef_to_json(treedef: tree_util.PyTreeDef) -> Any:
    """The JSON form of ``treedef``."""
    if tree_util.treedef_is_leaf(treedef) and treedef.num_leaves == 1:
        return None
    node_type, node_data = treedef.node_data()
    children = [treedef_to_json(c) for c in treedef.children()]
    if node_type is type(None):
        return {"none": True}
    if node_type is tuple:
        return {"tuple": children}
    if node_type is list:
        return {"list": children}
    if node_type is dict:
        return {"dict": dict(zip((str(k) for k in node_data), children))}
    return {"node": getattr(node_type, "__qualname__", str(node_type)), "children": children}
