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
of its own backends, so auto weighs it against kernels outside PyTorch.

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
import logging
import math
import itertools
import threading
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_BACKENDS", "AUTO_CANDIDATES", "AttentionDispatch", "KERNELS", "backend_unavailable_reason"]

ATTENTION_BACKENDS = ("auto", "sdpa", "cudnn", "flash", "efficient", "math", "fa3", "fa3_fp8")
#: What ``"auto"`` weighs, where available: PyTorch's own choice against kernels it does not have. Exact
#: kernels only: ``"fa3_fp8"`` changes the numbers and runs only where it is named.
AUTO_CANDIDATES = ("sdpa", "fa3")
_SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "math": "MATH"}
_TIMING_ITERS = 8
_TIMING_ROUNDS = 3
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0      # e4m3's largest finite value: a cast past it is NaN, so inputs are clamped first
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
                 candidates: tuple = AUTO_CANDIDATES):
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
        self._lock = threading.Lock()
        self._choices: dict[_Shape, dict] = {}
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
        on_cuda = self.device is not None and self.device.type == "cuda"
        if len(takers) == 1 and (takers[0] == "sdpa" or not on_cuda):
            name, timed, source = takers[0], {}, "only candidate"
        else:  # timed, which also tries each kernel once on this shape
            timed = {n: _time_kernel(n, shape, is_causal, self.device) for n in takers}
            name, source = min(timed, key=timed.get), "timed" if len(takers) > 1 else "only candidate"
            if "sdpa" in timed and timed[name] > timed["sdpa"] * (1 - _AUTO_MARGIN):
                name = "sdpa"  # within the timing's noise of PyTorch's own choice: keep the reference
            if timed[name] == math.inf:
                self._fallback(f"{name} failed on {shape.summary()}: sdpa")
                name, source = "sdpa", "fallback"
        record = {"shape": shape.summary(), "backend": name, "source": source,
                  "ms": {n: round(ms, 4) for n, ms in timed.items()}}
        with self._lock:
            self._choices.setdefault(shape, record)
        logger.info("attention %s: %s (%s%s)", shape.summary(), name, source,
                    "; " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in timed.items()) if timed else "")
        return name

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


def _time_kernel(name: str, shape: _Shape, is_causal: bool, device) -> float:
    """Median ms of kernel `name` on random inputs of `shape` (bshd), CUDA events on the current stream."""
    dtype = torch.bfloat16 if shape.dtype == _dtype_name(_FP8) else getattr(torch, shape.dtype)
    q = torch.randn(shape.batch, shape.q_len, shape.heads, shape.head_dim, device=device, dtype=dtype)
    k = torch.randn(shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    kernel = KERNELS[name]
    try:
        # timed as a kernel, not through whatever torch-function or dispatch modes are active (the
        # first call of a shape may be a break-placement probe, whose modes slow every launch)
        with torch.no_grad(), _no_modes():
            kernel(q, k, v, None, is_causal, None, "bshd")
            torch.cuda.synchronize(device)
            times = []
            for _ in range(_TIMING_ROUNDS):  # calls back to back: the GPU's time, not the host's launches
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(_TIMING_ITERS):
                    kernel(q, k, v, None, is_causal, None, "bshd")
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / _TIMING_ITERS)
    except RuntimeError as exc:  # the kernel refused this shape after all: never chosen
        logger.info("attention %s: %s failed (%s)", shape.summary(), name, str(exc).splitlines()[0][:200])
        return math.inf
    return sorted(times)[len(times) // 2]


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
