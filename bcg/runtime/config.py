"""Runner settings and the transformer's optimizations: two frozen dataclasses, read from ``BCG_*``
environment variables in one place.

`RunnerConfig` says how a runner captures, pools, replays and compiles (any module). `TransformerOptions`
says what `bcg.diffusers.accelerate` does to a pipeline's transformers before their runners wrap them
(float8 linears, the attention kernel, step caching next); it is validated here, once, and applied once,
through the transformer's hook registry (`bcg.runtime.hooks`).

`RunnerConfig()` holds the defaults; `RunnerConfig.from_env()` overrides each field from the variable
``BCG_<FIELD NAME IN CAPITALS>`` (``BCG_MAX_ENTRIES=8``, ``BCG_COPY_OUTPUTS=0``, ...). A value that does
not parse or fails validation logs one warning naming the variable and keeps the default, so a typo in
a deployment never takes a replica down. Adding a field needs no parsing code: values are parsed by
the field's annotated type.
"""
import dataclasses
import logging
import os
import re
import typing
from typing import Optional

from bcg.runtime.attention_names import ATTENTION_BACKENDS
from bcg.runtime.quantize import QUANTIZE_MODES

logger = logging.getLogger(__name__)

__all__ = ["RunnerConfig", "TransformerOptions"]

_ENV_PREFIX = "BCG_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """How a `BreakableGraphRunner` captures, caches and replays.

    enabled: False runs every call eagerly (eager reason ``disabled``).
    max_entries: captured signatures kept; the least recently *used* one is evicted for a new one.
    pool_budget_bytes: cap on graph-pool bytes attributed to live entries (None: no cap); a capture
        that alone exceeds it is refused and its signature blocked.
    max_segments: a capture with more graph segments than this disables the runner (with a reason):
        that many breaks means the graph saves little over eager.
    copy_outputs: return a clone of the static outputs (safe to keep across calls); False returns the
        static outputs themselves. They live in the graph pool that all of the runner's signatures
        share, so the runner's next replay of *any* signature, from any thread, may overwrite them (a
        graph captured earlier may use their memory for its intermediates), not only the next replay
        of the same one: read or copy them before the runner replays again.
    max_break_mismatches: a replay stopped by a break output mismatch (a break returned another shape,
        dtype or Python value than at capture) is answered eagerly and the graph is kept; after this
        many mismatches in a row for one signature its graph is dropped and the signature blocked
        (eager until ``reset()``). 1 blocks at the first mismatch.
    max_capture_retries: a capture that fails, where a hook installed on the module changes what it
        captures (automatic break placement makes the failing place a break: see
        ``bcg.runtime.hooks.HookRegistry.capture_failed``), is tried again, at most this many times per
        signature; then the signature is blocked. 0 blocks at the first failure.
    debug: check on every call that the module's weights were not replaced (costs a walk over the
        parameters per call) and log each replay.
    debug_single_break: capture the whole forward as one eager break, to tell runner bugs from
        capture bugs: replay then runs the module eagerly on the static buffers.
    capture_warmup_runs: eager runs on the capture stream before capturing (lazy init, autotuning).
    pool_expandable_segments: grow the graph pool as expandable segments during captures (one mapped
        range instead of one cudaMalloc per size class; measured 104 MiB instead of 118-142 MiB for one
        Flux capture, see ``bcg.graphs.pool.ExpandableSegments``). False: plain segments, reserved up front
        to the warm-up's peak.
    raw_launch: launch graph segments that draw no random numbers with ``cuGraphLaunch`` directly after
        their first replay (less host time per segment; experimental, see ``bcg.graphs.raw_launch.RawLaunch``).
    compile: compile the module with inductor (without inductor's own CUDA graphs) and capture the
        compiled code as segments, breaks still eager (see ``bcg.runtime.compile``). Compilation happens in the
        warm-up run before each capture, so it is part of warmup; cold calls while serving never compile.
    compile_dynamic: None lets dynamo decide (one recompile per size-dependent frame on the second
        shape, whose dynamic kernels then serve every later shape), True compiles dynamic shapes from the
        start, False specialises per shape (one compile per signature at warmup). Neither is faster
        everywhere: static kernels took 3.7% and 2.8% less GPU time per forward than dynamic ones on
        sd3-small at 512² and 1024², and 6% more on the 9.2 M Flux at 512² (benchmarks/results/
        bench_compiled_small_repeat.json against bench_compiled_small_static_repeat.json).
    compile_mode: inductor mode: None/"default" or "max-autotune-no-cudagraphs".
    compile_regional: compile only the module's repeated blocks (diffusers' ``_repeated_blocks``, else
        the classes that repeat in a ``ModuleList``), each class once, and run the code around them
        (embeddings, final norm) uncompiled inside the same graph segments: the compile takes a fraction
        of a whole-module compile for the same kernels where the time is spent (see
        ``bcg.runtime.compile``).
    compile_precompile: dynamo's caching precompile (experimental in torch; ``bcg.runtime.compile``):
        compile artifacts saved by this process (``torch.compiler.save_cache_artifacts``) also carry dynamo's
        traced frames, and a process that loads them runs the compiled code without tracing or compiling
        it again (inductor only). Process-wide once on.
    quantize, attention_backend: the transformer's, not the runner's: `TransformerOptions`. Passing them
        here is an error that says so (``BCG_QUANTIZE`` / ``BCG_ATTENTION_BACKEND`` still work: they set
        `TransformerOptions.from_env()`).
    """

    enabled: bool = True
    max_entries: int = 16
    pool_budget_bytes: Optional[int] = None
    max_segments: int = 512
    copy_outputs: bool = True
    max_break_mismatches: int = 3
    max_capture_retries: int = 4
    debug: bool = False
    debug_single_break: bool = False
    capture_warmup_runs: int = 1
    pool_expandable_segments: bool = True
    raw_launch: bool = False
    compile: bool = False
    compile_dynamic: Optional[bool] = None
    compile_mode: Optional[str] = None
    compile_regional: bool = False
    compile_precompile: bool = False
    # not fields: moved to TransformerOptions; accepted only to say so (their class attributes read None/"auto")
    quantize: dataclasses.InitVar[Optional[str]] = None
    attention_backend: dataclasses.InitVar[str] = "auto"

    def __post_init__(self, quantize=None, attention_backend="auto"):
        moved = {k: v for k, v in (("quantize", quantize), ("attention_backend", attention_backend))
                 if v != TransformerOptions.__dataclass_fields__[k].default}
        if moved:
            args = ", ".join(f"{k}={v!r}" for k, v in moved.items())
            raise ValueError(f"{', '.join(moved)} is a transformer option, not a runner setting: pass "
                             f"bcg.TransformerOptions({args}) as accelerate(pipe, options=...) (the app: its own "
                             f"args {', '.join(moved)}=..., not runner=)")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}; "
                             "use enabled=False to turn graphs off")
        if self.pool_budget_bytes is not None and self.pool_budget_bytes <= 0:
            raise ValueError(f"pool_budget_bytes must be a positive byte count or None for no budget, "
                             f"got {self.pool_budget_bytes}")
        if self.max_segments < 1:
            raise ValueError(f"max_segments must be >= 1, got {self.max_segments}")
        if self.max_break_mismatches < 1:
            raise ValueError(f"max_break_mismatches must be >= 1 (1 blocks a signature at its first break "
                             f"output mismatch), got {self.max_break_mismatches}")
        if self.max_capture_retries < 0:
            raise ValueError(f"max_capture_retries must be >= 0 (0 blocks a signature at its first failed "
                             f"capture), got {self.max_capture_retries}")
        if self.capture_warmup_runs < 0:
            raise ValueError(f"capture_warmup_runs must be >= 0, got {self.capture_warmup_runs}")
        if self.compile and self.capture_warmup_runs < 1:
            raise ValueError("compile=True needs capture_warmup_runs >= 1: compilation must happen "
                             "before the capture")

    @classmethod
    def env_var(cls, field_name):
        """The environment variable that sets `field_name`."""
        return _ENV_PREFIX + field_name.upper()

    @classmethod
    def from_env(cls, environ=None, **overrides):
        """Defaults, overridden by ``BCG_*`` variables of `environ` (default os.environ), then by
        `overrides`. Bad environment values warn and keep the default; bad overrides raise."""
        return _from_env(cls, environ, overrides)

    def as_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TransformerOptions:
    """What `bcg.diffusers.accelerate` does to a pipeline's transformers, once, before their runners wrap
    them; each is a hook in the transformer's registry (`bcg.runtime.hooks`), removed by ``unaccelerate``.

    quantize: None, or "fp8": the linear layers become float8 GEMMs (torchao, dynamic per-row activation
        scales, per-row weight scales; ``bcg.runtime.quantize``) before anything is captured or compiled.
        Where float8 cannot run, the report says why once and the module keeps its dtype. Compile it
        (``RunnerConfig(compile=True)``): uncompiled, float8 is slower than bf16.
    attention_backend: the attention kernel (see ``bcg.runtime.attention``): "auto" (default) times the
        available kernels per attention shape at warmup (interleaved, best round each; a served app
        shares one choice per device and shape through its coordinator) and keeps the fastest, or one of "sdpa"
        (PyTorch's own choice), "cudnn", "flash", "efficient", "math", "fa3" (FlashAttention-3, the
        ``fa3-fwd`` package), "fa3_fp8" (FA3 on float8 inputs: faster, less exact; never chosen by
        "auto"). A kernel that is missing or refuses a shape falls back to "sdpa" with a one-line reason.
    step_cache: reserved (None): step caching is enabled by ``bcg.diffusers.enable_step_cache`` before
        `accelerate` (a hook in diffusers' own registry of the transformer; see ``bcg.runtime.hooks``).

    Regional compilation stays the runner's (``RunnerConfig.compile_regional``: how a runner compiles);
    `accelerate` asks it of the transformers' runners only.
    """

    quantize: Optional[str] = None
    attention_backend: str = "auto"
    step_cache: Optional[typing.Any] = None

    def __post_init__(self):
        if self.quantize is not None and self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {list(QUANTIZE_MODES)} or None, got {self.quantize!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.step_cache is not None:
            raise ValueError("step_cache is not available yet; leave it None")

    env_var = RunnerConfig.env_var

    @classmethod
    def from_env(cls, environ=None, **overrides):
        """Defaults, overridden by ``BCG_QUANTIZE`` / ``BCG_ATTENTION_BACKEND`` of `environ` (default
        os.environ), then by `overrides`; a bad environment value warns and keeps the default."""
        return _from_env(cls, environ, overrides)

    @classmethod
    def split(cls, settings: typing.Mapping | None) -> tuple["TransformerOptions", dict]:
        """``(TransformerOptions, the rest)`` of one settings dict that holds both (the app's replica
        settings: ``runner`` plus ``quantize`` / ``attention_backend``); options not named come from the
        environment. Raises ValueError (naming the field) for a bad value."""
        settings = dict(settings or {})
        names = [f.name for f in dataclasses.fields(cls)]
        mine = {k: settings.pop(k) for k in names if k in settings}
        return cls.from_env(**mine), settings

    def as_dict(self):
        return dataclasses.asdict(self)


def _from_env(cls, environ, overrides):
    environ = os.environ if environ is None else environ
    values = {}
    defaults = cls()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = cls.env_var(field.name)
        raw = environ.get(name)
        if raw is None or hints[field.name] is typing.Optional[typing.Any]:
            continue
        try:
            value = _parse(raw, hints[field.name])
            dataclasses.replace(defaults, **{field.name: value})  # validates this field alone
        except ValueError as exc:
            logger.warning("ignoring %s=%r: %s; keeping the default %r",
                           name, raw, exc, getattr(defaults, field.name))
            continue
        values[field.name] = value
    try:
        config = cls(**values)
    except ValueError as exc:  # fields valid alone but not together
        logger.warning("ignoring BCG_* settings %s: %s; using the defaults", values, exc)
        config = defaults
    return dataclasses.replace(config, **overrides) if overrides else config


def _parse(raw, annotation):
    """Parse an environment string by the field's annotated type (bool, int, float, str, Optional).

    An optional field is None for "", "none", "null" or "auto". For ``Optional[bool]`` "0" is False
    (the 1/0 grammar of every bool: ``BCG_COMPILE_DYNAMIC=0`` means static shapes); for other optional
    fields "0" also means None (``BCG_POOL_BUDGET_BYTES=0``: no budget).
    """
    text = raw.strip()
    base, optional = annotation, False
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        base, optional = args[0], len(args) < len(typing.get_args(annotation))
    none_words = {"", "none", "null", "auto"} if base is bool else {"", "none", "null", "auto", "0"}
    if optional and text.lower() in none_words:
        return None
    if base is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
    if base is int:
        return _parse_int(text)
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("expected a number") from None
    return text


def _parse_int(text):
    """An integer, optionally with a byte unit: ``4096``, ``2GiB``, ``512MB``, ``1_000``."""
    match = re.fullmatch(r"([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError("expected an integer, optionally with a unit like 512MiB or 2GB")
    number, unit = match.group(1).replace("_", ""), _BYTE_UNITS[match.group(2).lower()]
    if "." in number and unit == 1:
        raise ValueError("expected an integer")
    return int(float(number) * unit) if "." in number else int(number) * unit
