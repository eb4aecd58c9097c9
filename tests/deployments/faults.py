"""Fault injection for the app tests: pipeline hooks for build_app's ``pipeline_hook`` arg.

Each hook registers a forward pre-hook on the pipeline's transformer that acts on one image size,
recognised by the number of packed latent tokens (tiny-flux: ``(W/16) * (H/16)``):

* ``fail_96``: 96x96 raises (warmup and serving) and 112x112 sleeps ``SLOW_S`` per transformer call;
* ``slow_112``: only a sleep of 112x112, ``SLOW_112_S`` per transformer call;
* ``fail_capture_96`` (GPU): 96x96 raises only while a CUDA graph is being captured;
* ``oom_capture_512x256`` (GPU): 512x256 raises ``torch.cuda.OutOfMemoryError`` while capturing;
* ``fail_guidance``: a transformer call with a row at embedded guidance ``POISON_GUIDANCE`` raises (a
  request that fails for its own reason, inside whatever batch it joined).
"""
import time

import torch

FAIL_SIZE, SLOW_SIZE, OOM_SIZE = "96x96", "112x112", "512x256"
SLOW_S = 9.0        # longer than the faults app's request_timeout_s
SLOW_112_S = 2.5    # a warmup of 112x112 makes one call per batch bucket (4 of them): 10 s to watch it run
POISON_GUIDANCE = 7.25


def _tokens(size: str) -> int:
    w, h = (int(x) for x in size.split("x"))
    return (w // 16) * (h // 16)


def _hidden_tokens(args, kwargs) -> int:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return int(hidden.shape[1]) if hidden is not None and hidden.dim() == 3 else -1


def fail_96(pipe):
    def pre(module, args, kwargs):
        if _hidden_tokens(args, kwargs) == _tokens(FAIL_SIZE):
            raise RuntimeError(f"injected fault for {FAIL_SIZE}")
    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    _sleep_at_slow_size(pipe, SLOW_S)


def slow_112(pipe):
    _sleep_at_slow_size(pipe, SLOW_112_S)


def _sleep_at_slow_size(pipe, seconds: float):
    def pre(module, args, kwargs):
        if _hidden_tokens(args, kwargs) == _tokens(SLOW_SIZE):
            time.sleep(seconds)
    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)


def fail_capture_96(pipe):
    def pre(module, args, kwargs):
        if torch.cuda.is_current_stream_capturing() and _hidden_tokens(args, kwargs) == _tokens(FAIL_SIZE):
            raise RuntimeError(f"injected capture fault for {FAIL_SIZE}")
    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)


def oom_capture_512x256(pipe):
    def pre(module, args, kwargs):
        if torch.cuda.is_current_stream_capturing() and _hidden_tokens(args, kwargs) == _tokens(OOM_SIZE):
            raise torch.cuda.OutOfMemoryError(f"injected: CUDA out of memory capturing {OOM_SIZE}")
    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)


def fail_capture_96_and_oom_512x256(pipe):
    fail_capture_96(pipe)
    oom_capture_512x256(pipe)


def fail_guidance(pipe):
    def pre(module, args, kwargs):
        guidance = kwargs.get("guidance")
        if guidance is not None and bool((guidance == POISON_GUIDANCE).any()):
            raise ValueError(f"injected fault for guidance {POISON_GUIDANCE}")
    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
