"""Compiled segments: inductor kernels inside breakable CUDA graphs.

`compile_for_segments(module, ...)` wraps ``torch.compile(module)`` (inductor by default, *without* its own
CUDA graphs: ``{"triton.cudagraphs": False}``, ``fullgraph=False``) in a `CompiledForward`. Every
``eager_on_graph`` break is a ``torch.compiler.disable`` function, so dynamo graph-breaks there: the
forward runs as compiled graph, eager break, compiled graph, ... and a `BreakableCUDAGraphCapture` around
one call records the inductor kernels into its segments while the breaks stay eager Python calls.

Contract:
- ``CompiledForward(*args, **kwargs)`` runs the compiled forward (under ``torch.no_grad()`` unless
  ``inference=False``) and compiles whatever the call needs (regional: the first call of a signature runs
  the forward twice, since code around the regions may run the first one eagerly). Compilation must not happen inside a CUDA
  graph capture (inductor autotunes by running kernels): the first call of each signature must be an
  ordinary call (the runner's warm-up run on the capture stream is one). A call that would compile during
  a capture raises ``RuntimeError`` before running (new signature) or from the backend (recompile).
- ``CompiledForward.run_cached(...)`` never compiles: frames with cached code run it, others run eagerly
  (``torch.compiler.set_stance("eager_on_recompile")``) -- for cold calls while serving.
- ``stats()``: first-call wall time per signature (the compile time, part of warmup), graphs compiled,
  *frames* compiled (distinct Python frames: the module's forward, each block's forward, the resume
  functions after each break), *recompiles* (a further graph for a frame that already had one, with
  dynamo's guard-failure reason), all attributed to the signature whose call triggered them.
- Shapes: ``dynamic=None`` is dynamo's automatic dynamic: the first signature compiles static kernels, the
  first signature with other sizes recompiles each size-dependent frame once with dynamic sizes, later
  signatures reuse that. ``dynamic=True`` compiles dynamic kernels from the start (no recompile for new
  sizes where the model allows it), ``dynamic=False`` recompiles static kernels for every new size.
  ``mark_dynamic={"hidden_states": 1, ...}`` marks input dims before each call
  (``torch._dynamo.maybe_mark_dynamic``): it reaches only the frame that receives the inputs, not the
  frames that resume after a break (their inputs are fresh tensors), nor a forward that dynamo skips.
- Outputs equal those of the uncompiled module up to inductor's numerics (fusions reorder float math);
  replaying a capture of the compiled forward equals the compiled forward bit for bit.
- Without CUDA everything works with any backend; ``backend="eager"`` / ``"aot_eager"`` need no C++ build.
- ``precompile=True`` (inductor only) turns on dynamo's caching precompile for the process
  (``torch._dynamo.config.caching_precompile``, experimental in torch): ``torch.compiler.save_cache_artifacts()``
  then also holds dynamo's compiled frames with their guards, and a process that loads those artifacts
  before its first call runs the compiled code without tracing or compiling (``stats()``: no graphs
  compiled). Where torch has no such setting it logs that once and compiles as before.
- `dynamo_seconds()`: this process's dynamo time so far, whole-frame and backend (inductor), read from
  torch's own timers; the difference is tracing. Callers take the difference around a warmup.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Mapping

import torch

from bcg.runtime.hooks import HookRegistry
from bcg.runtime.proxy import ModuleProxy
from bcg.runtime.signature import call_arguments, signature_of

logger = logging.getLogger(__name__)

__all__ = ["BREAKS_HOOK", "CompileEvent", "CompiledForward", "DEFAULT_INDUCTOR_OPTIONS",
           "compile_for_segments", "dynamo_seconds", "enable_precompile", "repeated_blocks"]

#: Inductor without its own CUDA graphs: the breakable capture records the kernels instead.
DEFAULT_INDUCTOR_OPTIONS = {"triton.cudagraphs": False}

#: The name of the hook (`bcg.runtime.hooks`) that holds a module's breaks. Its ``compiled_breaks``, when
#: not None, is ``make_visible(module)``: what turns the breaks placed in it into breaks that dynamo sees on
#: every call. Breaks that act only while a capture is open (so a compiled warm-up call would trace without
#: them) need it; the code that placed them sets it, and `compile_for_segments` calls it. The core knows no
#: kind of break placement itself.
BREAKS_HOOK = "bcg_breaks"

_MAX_EVENTS = 512    # compile events kept for stats(); counters keep counting past it


@dataclasses.dataclass
class CompileEvent:
    """One graph handed to the backend: which frame, whether it recompiles it, which signature caused it."""

    compile_id: str          # dynamo's "frame_id/frame_compile_id"
    frame_id: int | None
    frame_compile_id: int | None
    frame: str               # "forward (transformer_flux.py:443)": the Python frame dynamo compiled
    ops: int                 # call nodes in the FX graph
    graph_break: bool        # the graph ends at a graph break (an eager break), not at a return
    backend_ms: float        # time inside the backend (AOT autograd + inductor lowering and codegen)
    signature: str | None    # key of the signature whose call triggered the compile
    reasons: list = dataclasses.field(default_factory=list)  # guard failures that caused a recompile

    @property
    def recompile(self) -> bool:
        return bool(self.frame_compile_id)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "recompile": self.recompile}


@dataclasses.dataclass
class _SignatureRecord:
    key: str
    summary: str
    order: int
    calls: int = 0
    first_call_ms: float = 0.0
    graphs: int = 0
    new_frames: int = 0
    recompiles: int = 0
    backend_ms: float = 0.0
    reasons: list = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {"key": self.key, "signature": self.summary, "order": self.order, "calls": self.calls,
                "first_call_ms": round(self.first_call_ms, 3), "graphs": self.graphs,
                "new_frames": self.new_frames, "recompiles": self.recompiles,
                "backend_ms": round(self.backend_ms, 3), "recompile_reasons": list(self.reasons)}


class CompiledInCaptureError(RuntimeError):
    """torch.compile was about to compile inside a CUDA graph capture: a guard of the compiled code failed
    there although the warm-up runs before the capture had compiled what they met (a module whose control
    flow or shapes differ from one run to the next, such as a causal video VAE's frame cache)."""


def compiled_in_capture(exc: BaseException) -> CompiledInCaptureError | None:
    """The `CompiledInCaptureError` that `exc` is or was raised from (dynamo wraps a backend's error in
    ``BackendCompilerFailed``), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CompiledInCaptureError):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


class _CountingBackend:
    """Wraps the real backend: records each compiled graph, refuses to compile inside a CUDA capture."""

    def __init__(self, inner: Callable, owner: CompiledForward):
        self.inner = inner
        self.owner = owner
        # dynamo names the backend after this in its debug wrappers and logs
        self.compiler_name = getattr(inner, "compiler_name", None) or getattr(inner, "__name__", "custom")

    def __call__(self, gm, example_inputs):
        if _capturing():
            raise CompiledInCaptureError(
                "bcg.runtime.compile: torch.compile tried to compile a graph inside a CUDA graph capture (a guard "
                "failed, e.g. a new shape); run the compiled forward once for this signature before "
                "capturing (RunnerConfig.capture_warmup_runs >= 1)")
        start = time.perf_counter()
        compiled = self.inner(gm, example_inputs)
        self.owner._record_compile(gm, (time.perf_counter() - start) * 1e3)
        return compiled

    def get_compiler_config(self):  # dynamo exposes this on the compiled module
        getter = getattr(self.inner, "get_compiler_config", None)
        return getter() if getter is not None else None

    def reset(self):
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _compile_id(gm):
    cid = None
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - older or newer torch: fall back to the graph's metadata
        pass
    if cid is None:
        cid = getattr(gm, "meta", {}).get("dynamo_compile_id")
    frame_id = getattr(cid, "frame_id", None)
    frame_compile_id = getattr(cid, "frame_compile_id", None)
    text = f"{frame_id}/{frame_compile_id}" if frame_id is not None else str(cid)
    return text, frame_id, frame_compile_id


def _frame_name(gm) -> tuple[str, bool]:
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = getattr(reason, "user_stack", None) or []
    graph_break = bool(getattr(reason, "graph_break", False))
    if stack:
        top = stack[0]
        filename = str(getattr(top, "filename", "?")).rsplit("/", 1)[-1]
        return f"{getattr(top, 'name', '?')} ({filename}:{getattr(top, 'lineno', '?')})", graph_break
    return "?", graph_break


def _guard_failures() -> dict:
    try:
        from torch._dynamo.utils import guard_failures

        return guard_failures
    except Exception:  # noqa: BLE001
        return {}


def _make_backend(backend, mode, options, dynamic):
    if callable(backend):
        if mode is not None or options:
            raise ValueError("mode/options apply to the inductor backend only; configure your callable "
                             "backend yourself")
        return backend
    if backend == "inductor":
        if mode not in (None, "default", "max-autotune-no-cudagraphs"):
            raise ValueError(f"mode={mode!r} would make inductor capture its own CUDA graphs; use None, "
                             "'default' or 'max-autotune-no-cudagraphs' (the breakable capture records the kernels)")
        merged = {**DEFAULT_INDUCTOR_OPTIONS, **(options or {})}
        if merged.get("triton.cudagraphs"):
            raise ValueError("options={'triton.cudagraphs': True} conflicts with compiled segments: inductor's "
                             "CUDA graphs cannot contain eager breaks; leave it False")
        return torch._TorchCompileInductorWrapper(mode, merged, dynamic)
    if mode is not None or options:
        raise ValueError(f"mode/options apply to the inductor backend only, not backend={backend!r}")
    return torch._dynamo.lookup_backend(backend)


class CompiledForward(ModuleProxy):
    """``torch.compile``d module whose compiled regions a breakable CUDA graph can capture.

    Use it where the module would be called (the runner's ``_compiled``, or standalone); unknown attributes
    proxy to the module. See the module docstring for when it compiles and what ``stats()`` reports.
    """

    def __init__(self, module, *, backend="inductor", mode=None, options=None, dynamic=None,
                 mark_dynamic: Mapping[str, Any] | None = None, inference=True, recompile_limit=None,
                 regional=False, precompile=False):
        if precompile and backend != "inductor":
            # dynamo stores a precompiled frame with its backend's artifacts; others have none to load
            raise ValueError(f"precompile needs backend='inductor', got {backend!r}")
        self._precompile = enable_precompile() if precompile else False
        self._module = module
        self._backend_name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
        self._mode = mode
        self._options = {**DEFAULT_INDUCTOR_OPTIONS, **(options or {})} if backend == "inductor" else options
        self._dynamic = dynamic
        self._mark_dynamic = {name: _dims(name, dims) for name, dims in (mark_dynamic or {}).items()}
        self._inference = inference
        self._recompile_limit = recompile_limit
        self._backend = _CountingBackend(_make_backend(backend, mode, options, dynamic), self)
        self._regions = repeated_blocks(module) if regional else []
        if regional and not self._regions:
            logger.info("%s has no repeated blocks to compile one by one; compiling the whole module",
                        type(module).__name__)
        if self._regions:
            # Regional compilation: each repeated block compiled in place (nn.Module.compile), one compile
            # per block class serving every instance (dynamo treats parameters as inputs); the code around
            # the blocks runs uncompiled, and the breakable capture records both alike.
            for block in self._regions:
                block.compile(backend=self._backend, dynamic=dynamic, fullgraph=False)
            self._compiled = module
        else:
            self._compiled = torch.compile(module, backend=self._backend, dynamic=dynamic, fullgraph=False)
        self._lock = threading.RLock()
        self._signatures: dict = {}             # Signature -> _SignatureRecord
        self._current: _SignatureRecord | None = None
        self._events: list[CompileEvent] = []
        self._frames: dict = {}                 # frame_id -> {"frame", "graphs", "recompiles"}
        self._counts = dict(graphs=0, recompiles=0, graph_breaks=0, calls=0, cached_calls=0)
        self._stance_warned = False

    # -- calls ------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        """Run the compiled forward; compiles what this call needs (never inside a CUDA capture)."""
        signature = signature_of(call_arguments(args, kwargs))
        self._mark(kwargs)
        with self._lock:
            record = self._signatures.get(signature)
            first = record is None
            if first:
                if _capturing():
                    raise RuntimeError(
                        f"bcg.runtime.compile: first call of signature {signature.summary()} inside a CUDA graph "
                        "capture; it would compile there. Call it once outside the capture first (the runner "
                        "does with RunnerConfig.capture_warmup_runs >= 1)")
                record = _SignatureRecord(signature.key, signature.summary(), order=len(self._signatures))
                self._signatures[signature] = record
            record.calls += 1
            self._counts["calls"] += 1
            previous, self._current = self._current, record
            start = time.perf_counter()
            try:
                try:
                    with self._context():
                        out = self._compiled(*args, **kwargs)
                        if first and self._regions:
                            # With regional compilation the code around the regions is plain Python: the
                            # first call may run eagerly as a whole (a break-placement probe does), leaving
                            # the regions uncompiled; a second call compiles them here, not in a capture.
                            out = self._compiled(*args, **kwargs)
                except BaseException:
                    if first:  # not compiled after all: the next call is a first call again
                        self._signatures.pop(signature, None)
                    raise
                if first:
                    if torch.cuda.is_available() and not _capturing():
                        torch.cuda.synchronize()  # autotuning and lazy kernel loads belong to the first call
                    record.first_call_ms = (time.perf_counter() - start) * 1e3
                    logger.info("compiled forward: first call of %s took %.1f ms (%d graphs, %d recompiles)",
                                record.summary, record.first_call_ms, record.graphs, record.recompiles)
            finally:
                self._current = previous
        return out

    def run_cached(self, *args, **kwargs):
        """Run with the code compiled so far, never compiling: uncompiled frames run eagerly."""
        self._mark(kwargs)
        self._counts["cached_calls"] += 1
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is None:  # torch < 2.6: plain eager is the only call that cannot compile
            if not self._stance_warned:
                logger.warning("torch %s has no torch.compiler.set_stance; cold calls run the module eagerly",
                               torch.__version__)
                self._stance_warned = True
            with self._grad():
                return self._module(*args, **kwargs)
        with set_stance("eager_on_recompile"), self._context():
            return self._compiled(*args, **kwargs)

    # -- stats ------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Compile time per signature, graphs, frames and recompiles (with reasons); see module docstring."""
        with self._lock:
            records = sorted(self._signatures.values(), key=lambda r: r.order)
            signatures = [r.as_dict() for r in records]
            frames = [{"frame_id": fid, **info} for fid, info in sorted(self._frames.items(),
                                                                        key=lambda kv: (kv[0] is None, kv[0] or 0))]
            events = [e.as_dict() for e in self._events]
            counts = dict(self._counts)
        after_first = sum(r["recompiles"] for r in signatures[1:])
        return {
            "backend": self._backend_name,
            "regional": sorted({type(b).__name__ for b in self._regions}) or None,
            "mode": self._mode,
            "options": self._options,
            "dynamic": self._dynamic,
            "mark_dynamic": {k: list(v) for k, v in self._mark_dynamic.items()},
            "precompile": self._precompile,
            "graphs_compiled": counts["graphs"],
            "frames_compiled": len(frames),
            "recompiles": counts["recompiles"],
            "recompiles_after_first_signature": after_first,
            "graph_breaks": counts["graph_breaks"],
            "calls": counts["calls"],
            "cached_calls": counts["cached_calls"],
            "compile_ms_total": round(sum(r["first_call_ms"] for r in signatures), 3),
            "backend_ms_total": round(sum(e["backend_ms"] for e in events), 3),
            "signatures": signatures,
            "frames": frames,
            "events": events,
        }

    # -- attributes ------------------------------------------------------------------------------

    @property
    def compiled(self):
        """The ``torch.compile`` result (an ``OptimizedModule`` for modules)."""
        return self._compiled

    def __repr__(self):
        return (f"CompiledForward({type(self._module).__name__}, backend={self._backend_name}, "
                f"graphs={self._counts['graphs']}, recompiles={self._counts['recompiles']})")

    # -- internals --------------------------------------------------------------------------------

    def _grad(self):
        return torch.no_grad() if self._inference else contextlib.nullcontext()

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self._grad())
        if self._recompile_limit is not None:
            name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
            stack.enter_context(torch._dynamo.config.patch(**{name: self._recompile_limit}))
        if not self._precompile and getattr(torch._dynamo.config, "caching_precompile", False):
            # another forward of the process turned the precompile on: this one traces without it
            stack.enter_context(torch._dynamo.config.patch(caching_precompile=False))
        return stack

    def _mark(self, kwargs):
        for name, dims in self._mark_dynamic.items():
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor):
                for dim in dims:
                    if -value.dim() <= dim < value.dim():
                        torch._dynamo.maybe_mark_dynamic(value, dim % value.dim())

    def _record_compile(self, gm, backend_ms):
        """Called by the backend wrapper for every graph dynamo hands over."""
        text, frame_id, frame_compile_id = _compile_id(gm)
        frame, graph_break = _frame_name(gm)
        ops = sum(1 for n in gm.graph.nodes if n.op.startswith("call"))
        record = self._current
        reasons = []
        if frame_compile_id:
            # dynamo appends "frame_id/compile_id: reason" for the entries whose guards failed
            prefix = f"{frame_id}/"
            for values in _guard_failures().values():
                reasons.extend(str(v) for v in values if str(v).startswith(prefix))
            reasons = [r.splitlines()[0][:300] for r in reasons[-max(1, frame_compile_id):]]
        event = CompileEvent(compile_id=text, frame_id=frame_id, frame_compile_id=frame_compile_id, frame=frame,
                             ops=ops, graph_break=graph_break, backend_ms=round(backend_ms, 3),
                             signature=record.key if record is not None else None, reasons=reasons)
        self._counts["graphs"] += 1
        self._counts["graph_breaks"] += int(graph_break)
        info = self._frames.setdefault(frame_id, {"frame": frame, "graphs": 0, "recompiles": 0,
                                                  "recompile_reasons": []})
        info["graphs"] += 1
        if event.recompile:
            self._counts["recompiles"] += 1
            info["recompiles"] += 1
            info["recompile_reasons"].extend(reasons)
        if record is not None:
            record.graphs += 1
            record.backend_ms += backend_ms
            if event.recompile:
                record.recompiles += 1
                record.reasons.extend(f"{frame}: {r}" for r in reasons)
            else:
                record.new_frames += 1
        if len(self._events) < _MAX_EVENTS:
            self._events.append(event)
        logger.debug("compiled graph %s of %s (%d ops, %.1f ms)%s", text, frame, ops, backend_ms,
                     f", recompile: {reasons[-1]}" if reasons else "")


def repeated_blocks(module) -> list:
    """The instances of `module`'s repeated block classes: the class names diffusers lists in
    ``_repeated_blocks``, else the classes of which a ``ModuleList`` holds two or more (outermost first)."""
    if not isinstance(module, torch.nn.Module):
        return []
    names = set(getattr(module, "_repeated_blocks", None) or ())
    if not names:
        for sub in module.modules():
            if isinstance(sub, torch.nn.ModuleList):
                counts: dict = {}
                for child in sub:
                    counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
                names.update(n for n, c in counts.items() if c >= 2)
    blocks = [sub for sub in module.modules() if sub is not module and type(sub).__name__ in names]
    # a block nested in another block is compiled as part of it
    nested = {id(child) for block in blocks for child in block.modules() if child is not block}
    return [b for b in blocks if id(b) not in nested]


def _dims(name, dims) -> tuple:
    if isinstance(dims, int):
        return (dims,)
    try:
        if isinstance(dims, str):
            raise TypeError
        out = tuple(int(d) for d in dims)
    except (TypeError, ValueError):
        raise ValueError(f"mark_dynamic[{name!r}] must be a dim or a list of dims, got {dims!r}") from None
    return out


_precompile_missing_logged = False


def dynamo_seconds() -> dict:
    """``{"frames_s", "backend_s"}``: seconds dynamo spent compiling frames in this process so far, and of
    those the backend's (inductor: lowering, codegen, autotuning); what is left is tracing (bytecode,
    fake tensors, guards). Read from torch's ``compilation_time_metrics`` (private to dynamo): zeros
    where this torch has none, so a caller's trace time reads 0 rather than failing."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except ImportError:
        return {"frames_s": 0.0, "backend_s": 0.0}
    return {"frames_s": float(sum(metrics.get("_compile.compile_inner", ()))),
            "backend_s": float(sum(metrics.get("OutputGraph.call_user_compiler", ())))}


def enable_precompile() -> bool:
    """Turn on dynamo's caching precompile for this process (see the module docstring); False, with one
    log line, where this torch has none."""
    global _precompile_missing_logged
    config = torch._dynamo.config
    if not hasattr(config, "caching_precompile"):
        if not _precompile_missing_logged:
            logger.warning("torch %s has no dynamo caching precompile (torch._dynamo.config.caching_precompile): "
                           "compiled artifacts still skip inductor, not dynamo's tracing", torch.__version__)
            _precompile_missing_logged = True
        return False
    config.caching_precompile = True
    return True


def compile_for_segments(module, *, backend="inductor", mode=None, options=None, dynamic=None,
                         mark_dynamic: Mapping[str, Any] | None = None, breaks="installed", inference=True,
                         recompile_limit=None, regional=False, precompile=False) -> CompiledForward:
    """Compile `module` for capture as breakable CUDA graph segments; returns a `CompiledForward`.

    backend: "inductor" (default; compiled without its own CUDA graphs), "aot_eager", "eager" or a
        dynamo backend callable. mode: None, "default" or "max-autotune-no-cudagraphs" (inductor only).
    options: inductor options merged over ``{"triton.cudagraphs": False}``.
    dynamic: None (automatic dynamic), True (dynamic from the first compile) or False (static per size).
    mark_dynamic: ``{input name: dim or dims}`` marked dynamic before each call (a hint, never an error).
    breaks: ``"installed"`` (default) makes the breaks placed in the module visible to dynamo with the
        function their placement left in its ``bcg_breaks`` hook (`BREAKS_HOOK`; ``bcg.diffusers.install_breaks``
        leaves one that makes every attention core a break), if any; a callable ``breaks(module)`` does
        that instead; None leaves the module as it is (its own ``eager_on_graph`` calls still break).
    inference: run calls under ``torch.no_grad()`` (a grad-mode change would recompile every frame).
    recompile_limit: dynamo's per-frame recompile limit during calls (None: torch's default).
    regional: compile only the module's repeated blocks (`repeated_blocks`), each class once, in place;
        the rest of the forward runs uncompiled (captured all the same). Falls back to the whole module
        when it has none.
    precompile: dynamo's caching precompile for the process (inductor only; see the module docstring):
        saved compile artifacts then carry the traced frames, and loading them skips dynamo too.
    """
    if breaks == "installed":
        registry = HookRegistry.of(module)
        hook = registry.get_hook(BREAKS_HOOK) if registry is not None else None
        breaks = getattr(hook, "compiled_breaks", None)
    elif breaks is not None and not callable(breaks):
        raise ValueError(f"breaks must be 'installed', a callable breaks(module) or None, got {breaks!r}")
    if breaks is not None:
        breaks(module)
    return CompiledForward(module, backend=backend, mode=mode, options=options, dynamic=dynamic,
                           mark_dynamic=mark_dynamic, inference=inference, recompile_limit=recompile_limit,
                           regional=regional, precompile=precompile)
