"""Bridges: how a break's outputs reach the segment after it.

Contract: at capture, ``Bridges(name, out, fn, args, kwargs)`` allocates one buffer per tensor of the
break's output (inside the next segment's capture, so from the pool) and hands the model the same
structure over those buffers. At replay, ``make_step()`` calls the real break function with the held
arguments and copies its outputs into the buffers in place. Python scalars (None, bool, int, float,
complex, str) cannot be refreshed in place -- the segments after the break were captured with their
capture-time values -- so replay checks them by value. An output whose structure, shape, dtype or
Python value changed raises ``BreakOutputMismatchError`` before anything is copied, so no later segment
runs with a stale value. ``release()`` drops the strong
references once the segment that reads the buffers has ended, so the pool can reuse them.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from bcg.graphs.pool import alias

__all__ = ["BreakOutputMismatchError", "Bridges", "no_step", "no_work"]


class BreakOutputMismatchError(RuntimeError):
    """A break function returned, at replay, something other than what the graph was captured with."""


def no_work():
    """The function of a break that only splits a segment (``break_graph()``)."""
    return None


no_work.__qualname__ = no_work.__name__ = "break_graph"  # how it shows in graph.break_names


def no_step() -> None:
    """The replay step of a break with no work; captures drop it from the replay sequence."""
    return None


_SCALARS = (bool, int, float, complex, str)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)} {x.dtype}"
    if isinstance(x, _SCALARS):
        return f"{type(x).__name__} {x!r}"
    return type(x).__name__


def _same_scalar(a, b) -> bool:
    """Equal Python scalars of one type; floats bit for bit (-0.0 is not 0.0, NaN is NaN)."""
    if type(a) is float:
        return a.hex() == b.hex()
    if type(a) is complex:
        return a.real.hex() == b.real.hex() and a.imag.hex() == b.imag.hex()
    return a == b


class Bridges:
    """Turns a break's capture-time output into bridge buffers, and copies replay outputs into them."""

    def __init__(self, name: str, out, fn=None, args=(), kwargs=None):
        self.name = name
        # What replay calls: the real function with the held arguments (see BreakableCUDAGraphCapture._hold).
        self.fn, self.args, self.kwargs = fn, args, kwargs or {}
        self.owned: list[torch.Tensor] = []  # strong refs, only until the segment that reads them ends
        self.targets: list[torch.Tensor] = []  # what replay copies into (aliases once the segment ended)
        self.paths: list[str] = []
        self.spec, self.result = self._build(out, "output")

    def _build(self, x, path):
        if isinstance(x, torch.Tensor):
            # Allocated inside the just-begun segment's capture: comes from the pool.
            bridge = torch.empty_like(x, memory_format=torch.preserve_format)
            self.owned.append(bridge)
            self.targets.append(bridge)
            self.paths.append(path)
            return ("t", len(self.targets) - 1, x.shape, x.dtype), bridge
        if isinstance(x, (tuple, list)):
            specs, values = [], []
            for i, item in enumerate(x):
                s, v = self._build(item, f"{path}[{i}]")
                specs.append(s)
                values.append(v)
            kind = type(x)
            if hasattr(x, "_fields"):
                value = kind(*values)
            else:
                value = kind(values)
            return ("seq", kind, tuple(specs)), value
        if isinstance(x, dict):
            specs, values = {}, {}
            for k, item in x.items():
                s, v = self._build(item, f"{path}[{k!r}]")
                specs[k] = s
                values[k] = v
            value = type(x)(values) if type(x) is not dict else values
            return ("map", type(x), specs), value
        if x is None or isinstance(x, _SCALARS):
            return ("c", type(x), x), x
        raise TypeError(
            f"break function {self.name} returned {type(x).__name__} at {path}; break outputs must be "
            "tensors, None, python scalars, or tuples/lists/dicts of them"
        )

    def release(self) -> None:
        """The segment that reads the bridges ended: keep only aliases, so the pool can reuse them.

        ``result`` (the structure handed to the model at capture) goes too: it holds the bridges.
        """
        self.targets = [alias(t) if t.is_cuda else t for t in self.targets]
        self.owned = []
        self.result = None

    def make_step(self) -> Callable[[], None]:
        """The replay closure of this break: call the real function, copy its outputs into the bridges.

        Everything is bound here, at capture, so a replay step is one call and one copy per output.
        """
        fn, args, kwargs = self.fn, self.args, self.kwargs
        if fn is no_work:
            return no_step
        if not self.targets and self.spec == ("c", type(None), None):
            return functools.partial(fn, *args, **kwargs)
        copy = self.make_copier()
        if kwargs:
            def step():
                copy(fn(*args, **kwargs))
        else:
            def step():
                copy(fn(*args))
        return step

    def make_copier(self) -> Callable[[Any], None]:
        """A closure that checks a replay output against the spec and copies it into the bridges."""
        spec, targets = self.spec, self.targets
        if spec[0] == "t":
            (target,), shape, dtype = targets, spec[2], spec[3]

            def copy_single(out):
                if not isinstance(out, torch.Tensor) or out.shape != shape or out.dtype != dtype:
                    self._mismatch("output", f"tensor{tuple(shape)} {dtype}", _describe(out))
                target.copy_(out)

            return copy_single
        if spec[0] == "seq" and all(s[0] == "t" for s in spec[2]):
            kind, n = spec[1], len(spec[2])
            checks = [(targets[s[1]], s[2], s[3]) for s in spec[2]]

            def copy_flat(out):
                if type(out) is not kind or len(out) != n:
                    self._mismatch("output", f"{kind.__name__} of {n} tensors", _describe(out))
                for i, ((_, shape, dtype), t) in enumerate(zip(checks, out)):
                    if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype:
                        self._mismatch(f"output[{i}]", f"tensor{tuple(shape)} {dtype}", _describe(t))
                for (target, _, _), t in zip(checks, out):
                    target.copy_(t)

            return copy_flat
        if not targets:
            def copy_none(out):
                self._check(spec, out, "output", [])

            return copy_none

        def copy_tree(out):
            leaves: list[torch.Tensor] = []
            self._check(spec, out, "output", leaves)
            for target, t in zip(targets, leaves):
                target.copy_(t)

        return copy_tree

    def _check(self, spec, x, path, leaves):
        kind = spec[0]
        if kind == "t":
            if not isinstance(x, torch.Tensor) or x.shape != spec[2] or x.dtype != spec[3]:
                self._mismatch(path, f"tensor{tuple(spec[2])} {spec[3]}", _describe(x))
            leaves.append(x)
        elif kind == "seq":
            if type(x) is not spec[1] or len(x) != len(spec[2]):
                self._mismatch(path, f"{spec[1].__name__} of length {len(spec[2])}", _describe(x))
            for i, (s, item) in enumerate(zip(spec[2], x)):
                self._check(s, item, f"{path}[{i}]", leaves)
        elif kind == "map":
            if type(x) is not spec[1] or x.keys() != spec[2].keys():
                self._mismatch(path, f"{spec[1].__name__} with keys {list(spec[2])}", _describe(x))
            for k, s in spec[2].items():
                self._check(s, x[k], f"{path}[{k!r}]", leaves)
        elif type(x) is not spec[1]:
            self._mismatch(path, _describe(spec[2]), _describe(x))
        elif spec[1] is not type(None) and not _same_scalar(x, spec[2]):
            self._mismatch(path, _describe(spec[2]), _describe(x), scalar=True)

    def _mismatch(self, path, expected, got, scalar=False):
        fix = ("the segments after a break were captured with its Python values: return a tensor for a "
               "value that changes between calls, or pass it as an argument of the captured call (arguments "
               "are part of the signature)"
               if scalar else
               "a graph replays fixed shapes: capture a new graph for this input (or make the break "
               "return what it returned at capture)")
        raise BreakOutputMismatchError(
            f"break function {self.name} returned {got} at {path} during replay, but the graph was captured "
            f"with {expected}; {fix}"
        )
