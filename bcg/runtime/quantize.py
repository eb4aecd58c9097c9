"""Weight and activation quantization of a module's linear layers, before it is captured or compiled.

`quantize_module(module, "fp8")` swaps the weights of the module's ``nn.Linear`` layers for torchao's
float8 tensors (``Float8DynamicActivationFloat8WeightConfig`` with per-row scales: each weight row and
each activation row gets its own scale, the activation's computed on the fly in every call), so every
linear runs as a float8 GEMM (``torch._scaled_mm``) with bf16 output. Everything else (norms, attention,
embeddings) stays as it was. The quantized module is an ordinary module: a breakable CUDA graph
captures its kernels and inductor compiles and fuses its quantization, like any other code. Compile it:
uncompiled, each activation's scale and cast are separate eager kernels and the float8 model is slower than
bf16 (FLUX.1-dev 1024² on one graph: 213.5 against 174.8 ms a forward on the H200; the plain form below is
1.19x faster than bf16 there: 151.65 against 181.05 ms, H100). Quantizing leaves
inductor's process-wide settings as they were (torchao's ``set_inductor_config`` is off).

That is the ``"torchao"`` form, for a transformer inductor compiles. ``form="plain"`` makes the same scheme of
plain tensors instead (`bcg.runtime.float8_linear.Float8Linear`: float8 weights and per-row scales, each input
quantized by one fused kernel): for plain graphs, and for dynamo's caching precompile, which cannot carry
torchao's tensor subclass (`bcg.diffusers.accelerated.quantize_form` picks).

Where float8 cannot run -- no CUDA device, compute capability below 8.9 (float8 tensor cores arrived with
Ada and Hopper), torchao not installed, a layer torchao refuses -- nothing is changed: the returned
`QuantizeReport` says why (``applied=False``, ``reason``) and one warning is logged. A caller serves the
module in its own dtype then; a request never fails because of it.

The report is kept in the module's hook registry (`bcg.runtime.hooks`, hook ``bcg_quantize``), which is
what makes a second call a no-op. A module whose quantized state was stored once and reloaded as it is
(`bcg.runtime.weights_store`, `bcg.diffusers.models.load_pipeline`) gets the stored report back
(`restore_report`, with ``reloaded_from``); `quantize_fields` is what such a state is keyed by. Removing that hook forgets the report but does not undo the float8
weights: that would need a second copy of every weight kept for it (a fresh module is the undo).

Layers whose input or output features are not multiples of 16 (float8 GEMMs need that), layers whose
weights are not bf16 (the per-row scheme takes bf16 only; e.g. the modules a model keeps in fp32, such as
Wan's ``_keep_in_fp32_modules``), and the layers a caller names in ``skip`` (fnmatch patterns on qualified
names), stay in their dtype.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import time
from typing import Iterable

import torch

from bcg.runtime.hooks import HookRegistry, ModelHook

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZE_MODES", "QuantizeReport", "fp8_unavailable_reason", "quantize_fields", "quantize_module",
           "quantize_report", "restore_report"]

#: What `TransformerOptions.quantize` accepts (None: no quantization).
QUANTIZE_MODES = ("fp8",)
#: Each mode's scheme, as its report names it.
SCHEMES = {"fp8": "float8 e4m3, per-row scales"}
#: The forms a mode's weights take: torchao's tensor subclass (what inductor fuses: for compiled graphs) or
#: plain float8 tensors with one fused activation kernel (`bcg.runtime.float8_linear`: for plain graphs).
QUANTIZE_FORMS = ("torchao", "plain")
#: Bumped whenever what `quantize_module` makes of the same weights changes (which layers it chooses, the
#: scheme's settings): states stored by an earlier version (`bcg.runtime.weights_store`) no longer match.
QUANTIZE_FORMAT = 1
_FP8_MIN_CAPABILITY = (8, 9)
HOOK_NAME = "bcg_quantize"


@dataclasses.dataclass
class QuantizeReport:
    """What `quantize_module` did: the mode asked for, whether it applied, why not, which layers."""

    mode: str | None
    form: str = "torchao"      # `QUANTIZE_FORMS`
    applied: bool = False
    reason: str | None = None
    layers: int = 0            # linear layers quantized
    skipped: int = 0           # linear layers left in their dtype (shape or `skip`)
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    scheme: str | None = None
    seconds: float = 0.0       # the call's time: choosing layers and quantizing their weights
    reloaded_from: str | None = None  # a state stored once (`bcg.runtime.weights_store`): quantized elsewhere

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def fp8_unavailable_reason(device: torch.device | str | None = None, form: str = "torchao") -> str | None:
    """Why float8 cannot run on `device` (None: it can): no CUDA, capability below 8.9, no torchao (the
    torchao form)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return f"fp8 needs a CUDA device, the module is on {device}"
    if not torch.cuda.is_available():
        return "fp8 needs a CUDA device and none is available"
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if capability < _FP8_MIN_CAPABILITY:
        return (f"fp8 needs compute capability >= 8.9 (Ada, Hopper or newer); "
                f"{torch.cuda.get_device_name(index)} has {capability[0]}.{capability[1]}")
    if form == "plain":
        return None
    try:
        _torchao_fp8()
    except ImportError as exc:
        return f"fp8 needs torchao (pip install 'bcg-serve[fp8]'): {exc}"
    return None


def quantize_module(module: torch.nn.Module, mode: str | None, *, skip: Iterable[str] = (),
                    device=None, form: str = "torchao") -> QuantizeReport:
    """Quantize `module`'s linear layers in place (see the module docstring) in `form` (`QUANTIZE_FORMS`);
    returns the report, which is also kept in the module's hook registry (``quantize_report(module)``).
    Quantizing twice is a no-op."""
    if mode is None:
        return QuantizeReport(mode=None)
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {list(QUANTIZE_MODES)} or None, got {mode!r}")
    if form not in QUANTIZE_FORMS:
        raise ValueError(f"quantize form must be one of {list(QUANTIZE_FORMS)}, got {form!r}")
    done = quantize_report(module)
    if done is not None:
        return done
    t0 = time.perf_counter()
    if device is None:
        first = next(module.parameters(), None)
        device = first.device if first is not None else None
    report = QuantizeReport(mode=mode, form=form)
    reason = fp8_unavailable_reason(device, form)
    if reason is not None:
        report.reason = reason
        logger.warning("%s stays in its dtype: %s", type(module).__name__, reason)
        report.seconds = time.perf_counter() - t0
        return _keep(module, report)
    patterns = list(skip)
    chosen, skipped = set(), 0
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.nn.Linear):
            continue
        if (any(fnmatch.fnmatchcase(name, p) for p in patterns) or sub.in_features % 16 or sub.out_features % 16
                or sub.weight.dtype != torch.bfloat16):  # the per-row scheme takes bf16 weights only
            skipped += 1
            continue
        chosen.add(id(sub))
        report.weight_bytes_before += sub.weight.numel() * sub.weight.element_size()
    try:
        if form == "plain":
            from bcg.runtime.float8_linear import install_float8_linears

            install_float8_linears(module, chosen)
            scheme = f"{SCHEMES[mode]}, plain tensors"
        else:
            quantize_, config, scheme = _torchao_fp8()
            quantize_(module, config, filter_fn=lambda sub, fqn: id(sub) in chosen)
    except Exception as exc:  # noqa: BLE001 -- a layer torchao refuses: serve unquantized, say why
        report.reason = f"torchao could not quantize {type(module).__name__}: {type(exc).__name__}: {exc}"
        logger.warning("%s stays in its dtype: %s", type(module).__name__, report.reason)
        report.seconds = time.perf_counter() - t0
        return _keep(module, report)
    report.applied, report.layers, report.skipped, report.scheme = True, len(chosen), skipped, scheme
    if form == "plain":  # the layers were replaced: count their float8 weights and scales
        from bcg.runtime.float8_linear import Float8Linear

        report.weight_bytes_after = sum(_nbytes(sub.weight) + _nbytes(sub.weight_scale) for sub in module.modules()
                                        if isinstance(sub, Float8Linear))
    else:
        report.weight_bytes_after = sum(_nbytes(sub.weight) for sub in module.modules()
                                        if isinstance(sub, torch.nn.Linear) and id(sub) in chosen)
    logger.info("%s: %d linear layers in float8 (%s), %d left in their dtype; weights %.2f -> %.2f GB",
                type(module).__name__, report.layers, scheme, skipped, report.weight_bytes_before / 1e9,
                report.weight_bytes_after / 1e9)
    report.seconds = time.perf_counter() - t0
    return _keep(module, report)


def quantize_fields(mode: str | None, skip: Iterable[str] = (), form: str = "torchao") -> dict:
    """What decides the weights `quantize_module` makes of a module's (beside the weights, their dtype and
    the versions and device of `bcg.runtime.weights_store.environment_fields`): the key fields of a stored
    quantized state."""
    fields = {"quantize": mode, "scheme": SCHEMES.get(mode), "quantize_format": QUANTIZE_FORMAT,
              "skip": sorted(skip)}
    if form != "torchao":  # torchao's keys stay what they were (entries stored before forms existed)
        fields["form"] = form
    return fields


def restore_report(module, report: dict, **changes) -> QuantizeReport:
    """Keep in `module`'s registry the report of a quantization made elsewhere and reloaded as it is
    (`bcg.runtime.weights_store`), with `changes` (where it came from, the reload's seconds); `quantize_module`
    is then a no-op on it."""
    fields = {f.name for f in dataclasses.fields(QuantizeReport)}
    return _keep(module, QuantizeReport(**{**{k: v for k, v in report.items() if k in fields}, **changes}))


def quantize_report(module) -> QuantizeReport | None:
    """The report of the `quantize_module` call that changed (or declined to change) `module`, if any."""
    registry = HookRegistry.of(module)
    hook = registry.get_hook(HOOK_NAME) if registry is not None else None
    return hook.report if hook is not None else None


class QuantizeHook(ModelHook):
    """The report of the quantization of a module, in its registry (installs nothing of its own)."""

    def __init__(self, report: QuantizeReport):
        super().__init__()
        self.report = report


def _keep(module, report):
    HookRegistry.check_if_exists_or_initialize(module).register_hook(QuantizeHook(report), HOOK_NAME)
    return report


def _nbytes(tensor) -> int:
    """Bytes of a weight, float8 subclass tensors included (their data and scales)."""
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is not None:
        names, _ = inner()
        return sum(_nbytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def _torchao_fp8():
    """(quantize_, config, scheme name) of torchao's float8 dynamic-activation, float8-weight scheme."""
    from torchao.quantization import quantize_  # ImportError names what is missing

    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    # set_inductor_config=False: torchao's default turns on inductor's coordinate-descent tuning for the whole
    # process, which tunes every kernel of every later compile, bf16 ones included (measured on the H200:
    # about 180 s more on the first call of a regional compile, FLUX.1-dev 1024²). Compiles here keep
    # inductor's defaults.
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    return quantize_, config, SCHEMES["fp8"]
