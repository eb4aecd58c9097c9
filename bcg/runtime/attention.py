"""The attention kernel per shape: `AttentionDispatch` runs ``softmax(q k^T * scale) v`` with the kernel
chosen for the call's shape, inside captured and compiled segments alike.

Kernels (`ATTENTION_BACKENDS`): ``"sdpa"`` (``F.scaled_dot_product_attention`` with PyTorch's own choice;
the reference and the fallback), ``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"`` (SDPA restricted to
one of its backends), ``"fa3"`` (FlashAttention-3 forward from the ``fa3-fwd`` package: Hopper GPUs,
bf16, head dims up to 256, no mask), ``"fa3_fp8"`` (the same kernel on float8 e4m3 query, key and value,
cast without scaling and clamped to e4m3's range: faster on long sequences, its own switch because it
changes the numbers; `benchmarks/bench_fp8.py` measures it against fp32 attention). ``"auto"`` times the
candidates (`AUTO_CANDIDATES` that are available here) on the first call of each shape and keeps the
fastest for that shape, SDPA unless another kernel is at least 3% faster; SDPA already picks the fastest
of its own backends, so auto weighs it against kernels outside PyTorch. The timing is interleaved (A, B,
A, B, ... over `_TIMING_ROUNDS` rounds) and each candidate keeps its best round, so a load on the device
at that moment (another process compiling or serving) slows every candidate alike instead of the one
that happened to run under it.

One choice per device and shape, shared: ``"auto"``'s choices form a table (`export_choices` /
`import_choices`: a JSON-able dict with a version, for one `choice_scope` -- the device's name and the
torch version -- keyed by `choice_entry`: shape, dtype, causality and the candidates), and a dispatch
may be given a `shared` table (``shared.publish(scope, entry, record) -> record``) that it consults
before it times a shape: an imported choice is used untimed; a shape timed here is published and the
record the shared table answers with (the first one published for that entry) is the one that runs, so
processes that share a table never disagree. The record's ``source`` says where a choice came from:
``"timed"`` (here), ``"coordinator"`` / ``"store"`` (adopted; see ``deployments.attention_choices``),
``"only candidate"``, ``"fallback"``. A backend named explicitly is never overridden by a table.

When the choice is made: on the first call of each shape outside a CUDA graph capture -- the runner's
warm-up run before each capture is one. In code that dynamo compiles, the dispatch is one custom op
(``torch.ops.bcg.attention``): no graph break, nothing traced inside it, static or symbolic sizes alike
(one compiled graph serves every shape under automatic dynamic shapes), and the op chooses when it first
runs on real tensors. A shape first seen inside a capture runs the first kernel that takes it, untimed, and
says so in `stats()`. A kernel that is missing or refuses a shape (a mask, a dtype, a head dim) is never an error:
the call runs ``"sdpa"`` and the reason is logged once and counted. `stats()` ``"calls"`` counts the calls each
kernel ran (eager runs, warm-up runs and captures; a graph replay runs its captured kernel without a call),
so what ran is read there, not from the configured name.

Layouts: ``"bhsd"`` (batch, heads, sequence, head dim: SDPA's) or ``"bshd"`` (diffusers' dispatcher and
FlashAttention's); each kernel takes either through views, no copies.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import itertools
import threading
import time
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from bcg.runtime.attention_names import ATTENTION_BACKENDS, AUTO_CANDIDATES, CHOICES_VERSION

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_BACKENDS", "AUTO_CANDIDATES", "AttentionDispatch", "CHOICES_VERSION", "KERNELS",
           "backend_unavailable_reason", "choice_scope", "fastest", "interleaved_best", "time_candidates"]

_SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "math": "MATH"}
_TIMING_ITERS = 8
_TIMING_ROUNDS = 5    # interleaved rounds per candidate; each keeps its best
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0      # e4m3's largest finite value: a cast past it is NaN, so inputs are clamped first
_ADOPTED = ("coordinator", "store")  # where a choice not timed here came from (a record's "source")
_AUTO_MARGIN = 0.03   # "auto" leaves SDPA only for a kernel at least this much faster
_IDS = itertools.count()
_DISPATCHES: "weakref.WeakValueDictionary[int, AttentionDispatch]" = weakref.WeakValueDictionary()


def backend_unavailable_reason(name: str, device: torch.device | None = None) -> str | None:
    """Why kernel `name` cannot run on `device` at all (None: it may; a shape can still refuse it)."""
    if name not in ATTENTION_BACKENDS or name == "auto":
        return f"unknown attention backend {name!r}; choose from {list(ATTENTION_BACKENDS)}"
    if name in ("sdpa", "math"):
        return None
    on_cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
    if not on_cuda:
        return f"{name} needs a CUDA device"
    if name in ("fa3", "fa3_fp8"):
        capability = torch.cuda.get_device_capability(device)
        if capability[0] != 9:
            return f"{name} needs a Hopper GPU (compute capability 9.x), {torch.cuda.get_device_name(device)} is " \
                   f"{capability[0]}.{capability[1]}"
        try:
            _register_fa3()
        except ImportError as exc:
            return f"{name} needs the fa3-fwd package (pip install 'bcg-serve[fa3]'): {exc}"
    return None


def _register_fa3() -> None:
    import fa3_fwd_interface  # noqa: F401 -- registers torch.ops.fa3_fwd._flash_attn_forward (with a fake kernel)


@dataclasses.dataclass(frozen=True)
class _Shape:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str

    def summary(self) -> str:
        heads = f"{self.heads}" if self.heads == self.kv_heads else f"{self.heads}/{self.kv_heads}"
        return f"{self.batch}x{heads}x{self.q_len}x{self.kv_len}x{self.head_dim} {self.dtype}"


def _refusal(name: str, shape: _Shape, masked: bool) -> str | None:
    """Why kernel `name` refuses this call (None: it takes it)."""
    if name in ("cudnn", "flash") and masked:
        return f"{name} takes no attention mask here"
    if name in ("fa3", "fa3_fp8"):
        if masked:
            return f"{name} takes no attention mask"
        if shape.dtype != "bfloat16" and not (name == "fa3_fp8" and shape.dtype == _dtype_name(_FP8)):
            return f"fa3-fwd is built for bf16, got {shape.dtype}"
        if shape.head_dim > 256 or shape.head_dim % 8:
            return f"{name} needs a head dim <= 256 and a multiple of 8, got {shape.head_dim}"
        if shape.heads % shape.kv_heads:
            return f"{name} needs query heads a multiple of key heads, got {shape.heads}/{shape.kv_heads}"
    return None


class AttentionDispatch:
    """Attention with the kernel chosen per shape; one per model (see the module docstring)."""

    def __init__(self, backend: str = "auto", device: torch.device | str | None = None,
                 candidates: tuple = AUTO_CANDIDATES, timer: Callable | None = None):
        """`timer(names, shape, is_causal, device) -> {name: ms}` times the candidates of a shape
        (default `time_candidates`: interleaved, best round each)."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.device = torch.device(device) if device is not None else None
        self.unavailable: dict[str, str] = {}
        wanted = candidates if backend == "auto" else (backend,)
        self.candidates = []
        for name in wanted:
            reason = backend_unavailable_reason(name, self.device)
            if reason is None:
                self.candidates.append(name)
            else:
                self.unavailable[name] = reason
        if backend != "auto" and backend in self.unavailable:
            logger.warning("attention backend %s: %s; using sdpa", backend, self.unavailable[backend])
        if not self.candidates:
            self.candidates = ["sdpa"]
        self.timer = timer or time_candidates
        #: the shared table (None: this dispatch chooses alone): ``publish(scope, entry, record) -> record``
        self.shared = None
        self._lock = threading.Lock()
        self._choices: dict[_Shape, dict] = {}
        self._imported: dict[str, dict] = {}  # entry -> a record adopted from a table, not used yet
        self._fallbacks: dict[str, int] = {}
        self._calls: dict[str, int] = {}  # kernel -> calls it ran
        self._warned: set = set()
        self.id = next(_IDS)
        _DISPATCHES[self.id] = self  # the compiled op finds its dispatch by id (weakly held)

    # -- calls ------------------------------------------------------------------------------------

    def __call__(self, query, key, value, attn_mask=None, is_causal=False, scale=None, layout="bhsd"):
        """Attention of (q, k, v) in `layout`; the output has the same layout."""
        if torch.compiler.is_compiling():  # one opaque op in the graph: the choice is made when it runs
            if self._casts_to_fp8(query, key, attn_mask, layout):  # traced: inductor fuses the cast upstream
                query, key, value = _to_fp8(query), _to_fp8(key), _to_fp8(value)
            return torch.ops.bcg.attention(query, key, value, attn_mask, is_causal, scale, layout, self.id)
        return self.run(query, key, value, attn_mask, is_causal, scale, layout)

    def run(self, query, key, value, attn_mask=None, is_causal=False, scale=None, layout="bhsd"):
        """The call on concrete tensors: choose the kernel for this shape (first time: timed), run it."""
        name = self.choose(_shape_of(query, key, layout), attn_mask is not None, is_causal)
        with self._lock:
            self._calls[name] = self._calls.get(name, 0) + 1
        return KERNELS[name](query, key, value, attn_mask, is_causal, scale, layout)

    def _casts_to_fp8(self, query, key, attn_mask, layout) -> bool:
        """Whether compiled code hands this call to the op in float8: only when ``"fa3_fp8"`` will take it
        (`_refusal`'s conditions, from what tracing knows, in plain checks dynamo traces without a break)."""
        if "fa3_fp8" not in self.candidates or query.dtype != torch.bfloat16 or attn_mask is not None:
            return False
        heads = 1 if layout == "bhsd" else 2
        head_dim = query.shape[-1]
        return head_dim <= 256 and head_dim % 8 == 0 and query.shape[heads] % key.shape[heads] == 0

    # -- choice -----------------------------------------------------------------------------------

    def choose(self, shape: _Shape, masked: bool, is_causal: bool) -> str:
        """The kernel for this shape: chosen once (timed for ``"auto"``), then remembered."""
        with self._lock:
            known = self._choices.get(shape)
        if known is not None and not masked:
            return known["backend"]
        takers = [n for n in self.candidates if _refusal(n, shape, masked) is None]
        if not takers:
            refused = {n: _refusal(n, shape, masked) for n in self.candidates}
            self._fallback(f"{', '.join(refused)} refused {shape.summary()}: {'; '.join(refused.values())}")
            return "sdpa"
        if masked:
            return takers[0]
        if _capturing():  # nothing may run outside the graph now: choose at the next ordinary call
            self._fallback(f"first call of {shape.summary()} inside a capture: {takers[0]} untimed")
            return takers[0]
        entry = choice_entry(shape, is_causal, self.candidates)
        adopted = self._adoptable(entry, takers)
        on_cuda = self.device is not None and self.device.type == "cuda"
        extra: dict = {}
        if adopted is not None:  # a shared table's choice: not timed here
            name, timed, source = adopted["backend"], dict(adopted.get("ms") or {}), adopted["source"]
            extra = {"origin": adopted.get("origin")}
        elif len(takers) == 1 and (takers[0] == "sdpa" or not on_cuda):
            name, timed, source = takers[0], {}, "only candidate"
        else:  # timed, which also tries each kernel on this shape
            timed = self.timer(list(takers), shape, is_causal, self.device)
            name, source = fastest(timed), "timed" if len(takers) > 1 else "only candidate"
            if timed[name] == math.inf:
                self._fallback(f"{name} failed on {shape.summary()}: sdpa")
                name, source = "sdpa", "fallback"
            timed = {n: round(ms, 4) if math.isfinite(ms) else None for n, ms in timed.items()}  # JSON: no inf
            if source == "timed" and self.shared is not None:
                held = self._publish(entry, name, timed, takers)
                if held is not None:  # another process's choice holds: its figures, ours beside them
                    name, source, extra = held["backend"], held["source"], {"origin": held.get("origin"),
                                                                            "ms_here": timed}
                    timed = dict(held.get("ms") or {})
        record = {"shape": shape.summary(), "backend": name, "source": source, "ms": timed, "entry": entry, **extra}
        with self._lock:
            record = self._choices.setdefault(shape, record)
            self._imported.pop(entry, None)
        logger.info("attention %s: %s (%s%s)", shape.summary(), record["backend"], record["source"],
                    "; " + ", ".join(f"{n} {ms:.3f} ms" if ms is not None else f"{n} failed"
                                     for n, ms in record["ms"].items()) if record["ms"] else "")
        return record["backend"]

    # -- the shared table -------------------------------------------------------------------------

    @functools.cached_property
    def scope(self) -> dict:
        """What this dispatch's choices hold for: `choice_scope` of its device."""
        return choice_scope(self.device)

    def _adoptable(self, entry: str, takers: list) -> dict | None:
        """The imported record for `entry` when this dispatch adopts tables ("auto") and can run it."""
        if self.backend != "auto":
            return None
        with self._lock:
            record = self._imported.get(entry)
        if record is None:
            return None
        if record["backend"] not in takers:  # made where another kernel set ran: time it here
            self._fallback(f"a shared choice of {record['backend']} for {entry} cannot run here: timed")
            return None
        return record

    def _publish(self, entry: str, name: str, timed: dict, takers: list) -> dict | None:
        """Offer this process's choice for `entry` to the shared table; returns the record that holds
        there when it is another's (None: ours holds, or no table answered)."""
        try:
            held = self.shared.publish(dict(self.scope), entry, {"backend": name, "ms": dict(timed)})
        except Exception as exc:  # noqa: BLE001 -- no table reachable: this process's choice, counted
            self._fallback(f"choice of {entry} not shared ({type(exc).__name__}: {exc}): {name} as timed here")
            return None
        if held.get("source", "timed") == "timed":
            return None
        if held.get("backend") not in takers:
            self._fallback(f"the shared choice of {held.get('backend')} for {entry} cannot run here: {name}")
            return None
        return held

    def export_choices(self) -> dict:
        """The choices this dispatch timed or adopted (not forced ones: a named backend, the only
        candidate, a fallback), as a table `import_choices` reads: ``{"version", "scope", "choices":
        {entry: {"backend", "ms", "origin"}}}`` (a named backend's table is empty)."""
        choices: dict = {}
        if self.backend == "auto":
            with self._lock:
                records = [*self._imported.items(), *((r["entry"], r) for r in self._choices.values()
                                                      if r["source"] in ("timed", *_ADOPTED))]
            for entry, r in records:
                choices[entry] = {"backend": r["backend"], "ms": dict(r.get("ms") or {}), "origin": r.get("origin")}
        return {"version": CHOICES_VERSION, "scope": dict(self.scope), "choices": choices}

    def import_choices(self, table: dict, source: str = "coordinator") -> int:
        """Adopt the choices of `table` (`export_choices`' format) for shapes not chosen yet, each with
        its record's ``source`` when that is "coordinator" or "store", else `source`; returns how many
        were adopted. First write wins: a choice already made or imported here stays. A dispatch
        with a named backend adopts nothing. Raises ValueError naming the field for a table of another
        version or scope."""
        if not isinstance(table, dict):
            raise ValueError(f"attention choices: a table must be a dict, got {type(table).__name__}")
        if table.get("version") != CHOICES_VERSION:
            raise ValueError(f"attention choices: version {table.get('version')!r}, this code reads {CHOICES_VERSION}")
        if self.backend != "auto":
            return 0
        if table.get("scope") != self.scope:
            raise ValueError(f"attention choices: scope {table.get('scope')!r} is not this dispatch's {self.scope!r}")
        choices = table.get("choices")
        if not isinstance(choices, dict):
            raise ValueError("attention choices: 'choices' must be a dict of entry -> record")
        adopted = 0
        with self._lock:
            made = {r.get("entry") for r in self._choices.values()}
            for entry, record in choices.items():
                if not isinstance(record, dict) or record.get("backend") not in ATTENTION_BACKENDS:
                    raise ValueError(f"attention choices: choices[{entry!r}].backend must be one of "
                                     f"{list(ATTENTION_BACKENDS)}, got {record!r}")
                if entry in made or entry in self._imported:
                    continue
                self._imported[entry] = {"backend": record["backend"], "ms": dict(record.get("ms") or {}),
                                         "origin": record.get("origin"),
                                         "source": record["source"] if record.get("source") in _ADOPTED else source}
                adopted += 1
        return adopted

    def stats(self) -> dict:
        with self._lock:
            choices = [dict(r) for r in self._choices.values()]
            fallbacks, calls = dict(self._fallbacks), dict(self._calls)
        return {"backend": self.backend, "candidates": list(self.candidates), "unavailable": dict(self.unavailable),
                "choices": choices, "fallbacks": fallbacks, "calls": calls}

    def _fallback(self, reason: str) -> None:
        with self._lock:
            self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
            first = reason not in self._warned
            self._warned.add(reason)
        if first:
            logger.info("attention: %s", reason)


# -- helpers ---------------------------------------------------------------------------------------

def choice_scope(device) -> dict:
    """Where a timed choice holds: the device's name (a GPU's model; ``"cpu"``) and the torch version."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    else:
        name = device.type
    return {"device_name": name, "torch": torch.__version__}


def choice_entry(shape: "_Shape", is_causal: bool, candidates) -> str:
    """The key of one choice within a scope: the shape (sizes and dtype), causality and the kernels
    weighed (a process without one of them makes its own choice)."""
    return f"{shape.summary()} causal={int(bool(is_causal))} over {'+'.join(sorted(candidates))}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _shape_of(query, key, layout) -> _Shape:
    seq, heads = (2, 1) if layout == "bhsd" else (1, 2)
    return _Shape(query.shape[0], query.shape[heads], key.shape[heads], query.shape[seq], key.shape[seq],
                  query.shape[-1], _dtype_name(query.dtype))


# -- kernels ---------------------------------------------------------------------------------------

def _bhsd(x, layout):
    return x if layout == "bhsd" else x.transpose(1, 2)


def _back(out, layout):
    return out if layout == "bhsd" else out.transpose(1, 2)


def _sdpa(query, key, value, attn_mask, is_causal, scale, layout):
    if query.dtype == _FP8:  # handed over in float8 for fa3_fp8, which refused after all
        query, key, value = (x.to(torch.bfloat16) for x in (query, key, value))
    gqa = {"enable_gqa": True} if query.shape[1 if layout == "bhsd" else 2] != key.shape[1 if layout == "bhsd" else 2] else {}
    out = F.scaled_dot_product_attention(_bhsd(query, layout), _bhsd(key, layout), _bhsd(value, layout),
                                         attn_mask=attn_mask, is_causal=is_causal, scale=scale, **gqa)
    return _back(out, layout)


def _sdpa_only(name) -> Callable:
    def kernel(query, key, value, attn_mask, is_causal, scale, layout):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[name])):
            return _sdpa(query, key, value, attn_mask, is_causal, scale, layout)

    kernel.__name__ = f"_sdpa_{name}"
    return kernel


def _fa3(query, key, value, attn_mask, is_causal, scale, layout):
    def bshd(x):
        return x if layout == "bshd" else x.transpose(1, 2)

    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    # the registered op (torch.ops), not the Python CustomOpDef object: dynamo and inductor take it as one op
    out = torch.ops.fa3_fwd._flash_attn_forward(bshd(query), bshd(key), bshd(value), softmax_scale=scale,
                                                causal=is_causal)[0]
    return out if layout == "bshd" else out.transpose(1, 2)


def _to_fp8(x):
    return x if x.dtype == _FP8 else x.clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)


def _fa3_fp8(query, key, value, attn_mask, is_causal, scale, layout):
    return _fa3(_to_fp8(query), _to_fp8(key), _to_fp8(value), attn_mask, is_causal, scale, layout)


#: Each kernel by name: ``kernel(query, key, value, attn_mask, is_causal, scale, layout) -> out`` (no choice,
#: no fallback: what `AttentionDispatch` calls once it has chosen).
KERNELS = {"sdpa": _sdpa, "fa3": _fa3, "fa3_fp8": _fa3_fp8, **{name: _sdpa_only(name) for name in _SDPA_BACKENDS}}


def _no_modes():
    from torch.utils._python_dispatch import _disable_current_modes

    stack = contextlib.ExitStack()
    stack.enter_context(torch._C.DisableTorchFunction())
    stack.enter_context(_disable_current_modes())
    return stack


def fastest(timed: dict) -> str:
    """The kernel ``"auto"`` keeps from ``{name: ms}``: the fastest, SDPA unless another is at least
    `_AUTO_MARGIN` faster (within the timing's noise of PyTorch's own choice: keep the reference)."""
    name = min(timed, key=timed.get)
    if "sdpa" in timed and timed[name] > timed["sdpa"] * (1 - _AUTO_MARGIN):
        name = "sdpa"
    return name


def interleaved_best(measure: Callable[[str], float], names, rounds: int = _TIMING_ROUNDS) -> dict:
    """``{name: best ms}``: each of `names` measured `rounds` times, interleaved (a, b, a, b, ...), each
    keeping its best (least) round, so a load that comes and goes slows every name alike. A name whose
    `measure` returned inf (it failed) is measured no more."""
    best = {n: math.inf for n in names}
    failed: set = set()
    for _ in range(rounds):
        for name in names:
            if name in failed:
                continue
            ms = measure(name)
            if ms == math.inf:
                failed.add(name)
            best[name] = min(best[name], ms)
    return best


def time_candidates(names, shape: _Shape, is_causal: bool, device) -> dict:
    """``{name: ms}`` of each kernel in `names` on random inputs of `shape` (bshd): one call each first
    (a kernel that refuses the shape is inf, never chosen), then `interleaved_best` over calls timed by
    CUDA events on the current stream (the wall clock on a CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = torch.bfloat16 if shape.dtype == _dtype_name(_FP8) else getattr(torch, shape.dtype)
    q = torch.randn(shape.batch, shape.q_len, shape.heads, shape.head_dim, device=device, dtype=dtype)
    k = torch.randn(shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    on_cuda = device.type == "cuda"

    def call(name):
        KERNELS[name](q, k, v, None, is_causal, None, "bshd")

    def measure(name) -> float:
        try:
            if on_cuda:  # calls back to back: the GPU's time, not the host's launches
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(_TIMING_ITERS):
                    call(name)
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / _TIMING_ITERS
            t0 = time.perf_counter()
            for _ in range(_TIMING_ITERS):
                call(name)
            return (time.perf_counter() - t0) * 1e3 / _TIMING_ITERS
        except RuntimeError as exc:  # the kernel refused this shape after all: never chosen
            logger.info("attention %s: %s failed (%s)", shape.summary(), name, str(exc).splitlines()[0][:200])
            return math.inf

    # timed as kernels, not through whatever torch-function or dispatch modes are active (the first call
    # of a shape may be a break-placement probe, whose modes slow every launch)
    with torch.no_grad(), _no_modes():
        first = {}
        for name in names:
            try:
                call(name)
            except RuntimeError as exc:
                logger.info("attention %s: %s failed (%s)", shape.summary(), name, str(exc).splitlines()[0][:200])
                first[name] = math.inf
        if on_cuda:
            torch.cuda.synchronize(device)
        runs = [n for n in names if n not in first]
        return {**first, **interleaved_best(measure, runs)}


# -- the op compiled code calls --------------------------------------------------------------------
#
# In code dynamo compiles, a dispatch is this one custom op: opaque to dynamo and inductor (no graph break,
# nothing traced inside), its sizes symbolic or not, so one compiled graph serves every shape (automatic
# dynamic shapes) and each shape still gets its own kernel, chosen when the op first runs on real tensors
# (the runner's warm-up call, outside any capture). Its output is contiguous in the call's layout, as the
# fake kernel says.

@torch.library.custom_op("bcg::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  is_causal: bool, scale: Optional[float], layout: str, dispatch: int) -> torch.Tensor:
    return _DISPATCHES[dispatch].run(query, key, value, attn_mask, is_causal, scale, layout).contiguous()


@_attention_op.register_fake
def _(query, key, value, attn_mask, is_causal, scale, layout, dispatch):
    dtype = torch.bfloat16 if query.dtype == _FP8 else query.dtype  # fa3's float8 output is bf16
    return query.new_empty((*query.shape[:-1], value.shape[-1]), dtype=dtype)
