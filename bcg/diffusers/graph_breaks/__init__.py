"""Graph breaks in a DiT: where a transformer's forward leaves its CUDA graph for an eager function.

- `install`: `install_breaks` / `remove_breaks`, the policy dispatch (``auto``, ``attention``, ``processor``,
  selections);
- `wrapping`: what makes a place a break, recorded and undone by the transformer's `bcg_breaks` hook;
- `placement`: policy ``"auto"``: breaks only where the probe saw host operations a graph cannot hold;
- `hostops`: that probe; `compiled`: breaks dynamo can see.

Each builds on `wrapping`; `install` on all of them, none on `install`. Names are re-exported lazily.
"""
from bcg._lazy import lazy_exports

_EXPORTS = {
    "install_breaks": "bcg.diffusers.graph_breaks.install",
    "remove_breaks": "bcg.diffusers.graph_breaks.install",
    "auto_placement": "bcg.diffusers.graph_breaks.placement",
    "placement_stats": "bcg.diffusers.graph_breaks.placement",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
