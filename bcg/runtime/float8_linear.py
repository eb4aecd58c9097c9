"""Float8 linear layers as plain tensors, for graphs that are not compiled: `install_float8_linears`.

torchao's float8 layers (`bcg.runtime.quantize`'s other form) quantize each activation row inside a tensor
subclass's dispatch: compiled, inductor fuses that into the kernel before it; uncompiled, it runs as a
handful of eager kernels per linear (absolute value, row maximum, division, clamp, cast), each reading the
activation again, and float8 on plain graphs ends up slower than bf16. This form keeps what the GEMM needs
and nothing else:

* the layer's ``weight`` becomes a plain ``torch.float8_e4m3fn`` parameter (row-major, as ``nn.Linear``
  keeps it) and a buffer ``weight_scale`` (float32, one per output row) is registered beside it: both are
  in the module's ``state_dict``, so a quantized state stores and reloads as ordinary tensors
  (`bcg.runtime.weights_store` needs no trusted classes for it);
* each call quantizes its input per row with **one** kernel (`quantize_rows`: Triton on CUDA, reading the
  row for its maximum and once more to scale and cast; plain torch elsewhere) and runs
  ``torch._scaled_mm`` with both per-row scales and the bias, bf16 out -- the same scheme as torchao's
  ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` (scale = row maximum / 448).

Installed through each layer's hook registry (hook ``bcg_float8_linear``, `bcg.runtime.hooks`), which
replaces the layer's forward; removing the hook puts the forward back but not the bf16 weights (a fresh
module is the undo, as for torchao's form). `prepare_float8_linears` installs the same hooks over empty
float8 weights and scales, so that a stored state can be loaded into a module built from its config.
"""
from __future__ import annotations

import torch

from bcg.runtime.hooks import HookRegistry, ModelHook

__all__ = ["FLOAT8_DTYPE", "HOOK_NAME", "Float8LinearHook", "float8_linears", "install_float8_linears",
           "prepare_float8_linears", "quantize_rows", "triton_unavailable_reason"]

HOOK_NAME = "bcg_float8_linear"
FLOAT8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FLOAT8_DTYPE).max)  # 448
_EPS = 1e-12  # a row of zeros gets this maximum, so its scale is not 0 (torchao's float8 epsilon)

_TRITON = None  # (kernel, error): found on first use


def _triton_kernel():
    global _TRITON
    if _TRITON is None:
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def rows_to_float8(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride, eps, fp8_max,
                               BLOCK: tl.constexpr):
                row = tl.program_id(0).to(tl.int64)
                cols = tl.arange(0, BLOCK)
                peak = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK):
                    mask = start + cols < n_cols
                    v = tl.load(x_ptr + row * x_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
                    peak = tl.maximum(peak, tl.abs(v))
                scale = tl.maximum(tl.max(peak, axis=0), eps) / fp8_max
                tl.store(s_ptr + row, scale)
                for start in range(0, n_cols, BLOCK):
                    mask = start + cols < n_cols
                    v = tl.load(x_ptr + row * x_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
                    v = tl.minimum(tl.maximum(v / scale, -fp8_max), fp8_max)
                    tl.store(q_ptr + row * q_stride + start + cols, v.to(q_ptr.dtype.element_ty), mask=mask)

            _TRITON = (rows_to_float8, None)
        except Exception as exc:  # noqa: BLE001 -- no Triton (CPU wheels): the torch form runs
            _TRITON = (None, f"{type(exc).__name__}: {exc}")
    return _TRITON


def triton_unavailable_reason() -> str | None:
    """Why the fused kernel cannot run here (None: it can)."""
    return _triton_kernel()[1]


def quantize_rows(x: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a 2-D tensor: ``q = clamp(x / scale)`` in float8 e4m3 and ``scale`` (float32,
    shape ``(rows, 1)``) each row's absolute maximum over 448. `fused`: the Triton kernel (default: on CUDA
    where Triton is installed), else torch's ops."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor, got shape {tuple(x.shape)}")
    kernel = _triton_kernel()[0]
    if fused is None:
        fused = x.is_cuda and kernel is not None
    if not fused:
        peak = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_EPS)
        scale = peak / FP8_MAX
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FLOAT8_DTYPE), scale
    if kernel is None:
        raise RuntimeError(f"the fused float8 kernel needs Triton: {triton_unavailable_reason()}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FLOAT8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(2048, max(16, 1 << (cols - 1).bit_length()))
        kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), _EPS, FP8_MAX, BLOCK=block,
                        num_warps=4 if block <= 1024 else 8)
    return q, scale


class Float8LinearHook(ModelHook):
    """On one ``nn.Linear``: float8 weight and per-row scale (installed), the float8 GEMM as its forward."""

    def __init__(self, empty: bool = False):
        super().__init__()
        self.empty = empty  # install over empty tensors (a stored state is loaded into them next)

    def initialize_hook(self, module):
        weight = module.weight
        if self.empty:
            data = torch.empty(weight.shape, dtype=FLOAT8_DTYPE, device=weight.device)
            scale = torch.empty((weight.shape[0], 1), dtype=torch.float32, device=weight.device)
        else:
            data, scale = quantize_rows(weight.detach(), fused=False)
        module.weight = torch.nn.Parameter(data, requires_grad=False)
        module.register_buffer("weight_scale", scale)
        return module

    def deinitialize_hook(self, module):
        # the float8 weight stays (see the module docstring); the scale goes with the forward that reads it
        module._buffers.pop("weight_scale", None)
        return module

    def new_forward(self, module, x):
        shape = x.shape
        q, scale = quantize_rows(x.reshape(-1, shape[-1]))
        bias = module.bias
        out = torch._scaled_mm(q, module.weight.t(), scale_a=scale, scale_b=module.weight_scale.t(),
                               bias=bias.to(torch.bfloat16) if bias is not None else None,
                               out_dtype=torch.bfloat16)
        return out.reshape(*shape[:-1], out.shape[-1])


def install_float8_linears(module: torch.nn.Module, chosen: set, empty: bool = False) -> int:
    """Put each linear layer of `module` whose ``id`` is in `chosen` in float8 (this module's form);
    returns how many. A layer that has the hook already is left as it is."""
    count = 0
    for sub in module.modules():
        if id(sub) in chosen and isinstance(sub, torch.nn.Linear):
            registry = HookRegistry.check_if_exists_or_initialize(sub)
            if registry.get_hook(HOOK_NAME) is None:
                registry.register_hook(Float8LinearHook(empty=empty), HOOK_NAME)
                count += 1
    return count


def prepare_float8_linears(module: torch.nn.Module, names) -> int:
    """The hooks of `install_float8_linears` over empty float8 tensors, on the layers named (qualified
    names): a module built from its config, about to load a stored state."""
    names = set(names)
    return install_float8_linears(module, {id(sub) for name, sub in module.named_modules() if name in names},
                                  empty=True)


def float8_linears(module: torch.nn.Module) -> list[str]:
    """Qualified names of `module`'s layers in this form."""
    out = []
    for name, sub in module.named_modules():
        registry = HookRegistry.of(sub)
        if registry is not None and registry.get_hook(HOOK_NAME) is not None:
            out.append(name)
    return out
