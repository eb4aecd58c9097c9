"""Captured entries: one signature's graph with its static input buffers and outputs (`CaptureEntry`),
and the runner's cache of entries ordered by last use (`EntryCache`).

A replay of an entry is: ``copy_in`` (inputs into the static buffers, skipped for inputs that already
are the buffers), ``graph.replay()``, ``copy_out`` (clones of the static outputs, or the outputs
themselves). ``release`` drops the graph and buffers; the pool reuses their memory for later captures.
"""
import collections
import dataclasses

import torch
import torch.utils._pytree as pytree

__all__ = ["CaptureEntry", "EntryCache"]

_OUT_TENSOR, _OUT_TUPLE, _OUT_TREE = 0, 1, 2


@dataclasses.dataclass(eq=False)
class CaptureEntry:
    """One captured signature: its graph, static buffers, and how to hand outputs back."""

    signature: object
    graph: object
    static_inputs: list           # tensor leaves, in signature order
    output: object                # the static output structure, refreshed in place by replay
    capture_ms: float
    pool_bytes: int
    host_inputs: tuple = ()       # indices of inputs that arrive on another device (e.g. CPU)
    hits: int = 0
    last_used: float = 0.0
    break_mismatches: int = 0     # replays stopped by a break output mismatch (answered eagerly)
    mismatch_streak: int = 0      # of those, how many in a row, up to the last replay

    def __post_init__(self):
        leaves, self._out_spec = pytree.tree_flatten(self.output)
        self._out_leaves = leaves
        self._out_tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if isinstance(self.output, torch.Tensor):
            self._out_kind = _OUT_TENSOR
        elif type(self.output) is tuple and all(isinstance(x, torch.Tensor) for x in self.output):
            self._out_kind = _OUT_TUPLE
        else:
            self._out_kind = _OUT_TREE
        # static buffers never move: their addresses are read once, here
        self._device_inputs = [(i, s, s.data_ptr()) for i, s in enumerate(self.static_inputs)
                               if i not in self.host_inputs]

    @property
    def key(self):
        return self.signature.key

    @property
    def segments(self):
        return getattr(self.graph, "num_segments", 0)

    @property
    def breaks(self):
        return getattr(self.graph, "num_breaks", 0)

    def copy_in(self, leaves):
        """Copy call inputs into the static buffers, skipping those that already are the buffers."""
        dst, src = [], []
        for i, s, ptr in self._device_inputs:
            t = leaves[i]
            if t is not s and t.data_ptr() != ptr:
                dst.append(s)
                src.append(t)
        if dst:
            torch._foreach_copy_(dst, src)  # one launch for all same-device inputs
        for i in self.host_inputs:
            self.static_inputs[i].copy_(leaves[i])

    def copy_out(self, copy):
        """The outputs to hand to the caller: clones (safe to keep) or the static outputs."""
        if not copy:
            return self.output
        if self._out_kind == _OUT_TENSOR:
            return self.output.clone()
        if self._out_kind == _OUT_TUPLE:
            return tuple([t.clone() for t in self.output])
        leaves = list(self._out_leaves)
        for i in self._out_tensor_idx:
            leaves[i] = leaves[i].clone()
        return pytree.tree_unflatten(leaves, self._out_spec)

    def release(self):
        """Drop the graph and buffers; the pool reuses their memory for later captures."""
        graph, self.graph = self.graph, None
        if graph is not None and hasattr(graph, "reset"):
            graph.reset()
        self.static_inputs, self.output, self._out_leaves, self._device_inputs = [], None, [], []

    def describe(self):
        return {"key": self.key, "signature": self.signature.summary(), "segments": self.segments,
                "breaks": self.breaks, "capture_ms": round(self.capture_ms, 3), "pool_bytes": self.pool_bytes,
                "hits": self.hits, "break_mismatches": self.break_mismatches, "last_used": self.last_used}


class EntryCache:
    """Signature -> CaptureEntry, ordered by last use (least recently used first)."""

    def __init__(self):
        self._entries = collections.OrderedDict()

    def __len__(self):
        return len(self._entries)

    def __contains__(self, signature):
        return signature in self._entries

    def get(self, signature):
        return self._entries.get(signature)

    def add(self, entry):
        self._entries[entry.signature] = entry

    def touch(self, signature):
        self._entries.move_to_end(signature)

    def pop_lru(self):
        return self._entries.popitem(last=False)[1]

    def pop(self, signature):
        return self._entries.pop(signature)

    def entries(self):
        """Entries, least recently used first."""
        return list(self._entries.values())

    @property
    def pool_bytes(self):
        return sum(e.pool_bytes for e in self._entries.values())
