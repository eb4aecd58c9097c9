"""Float8 linear layers as plain tensors, for plain graphs and the precompile: `install_float8_linears`.

torchao's float8 layers (`bcg.runtime.quantize`'s other form) quantize each activation row inside a tensor
subclass's dispatch: compiled, inductor fuses that into the kernel before it; uncompiled, it runs as a
handful of eager kernels per linear (absolute value, row maximum, division, clamp, cast), each reading the
activation again, and float8 on plain graphs ends up slower than bf16. This form keeps what the GEMM needs
and nothing else:

* each chosen ``nn.Linear`` is replaced in its parent by a `Float8Linear` (a ``nn.Linear`` subclass, as
  `bcg.lora` replaces the layers it adapts): ``weight`` a plain ``torch.float8_e4m3fn`` parameter
  (row-major, as ``nn.Linear`` keeps it), a buffer ``weight_scale`` (float32, one per output row) and the
  layer's bias: all in the module's ``state_dict``, so a quantized state stores and reloads as ordinary
  tensors (`bcg.runtime.weights_store` needs no trusted classes for it), and a compile sees ordinary
  tensors (dynamo's caching precompile carries them, where it cannot carry torchao's subclass);
* each call quantizes its input per row with **one** kernel (`quantize_rows`: Triton on CUDA, reading the
  row for its maximum and once more to scale and cast; plain torch elsewhere, and where a compile traces
  the call, so that inductor fuses it into the kernel before it, as it fuses torchao's) and runs
  ``torch._scaled_mm`` with both per-row scales and the bias, bf16 out -- the same scheme as torchao's
  ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` (scale = row maximum / 448).

A fresh module is the undo, as for torchao's form. `prepare_float8_linears` puts the same layers, over
empty tensors, in a module built from its config, so that a stored state can be loaded into it.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["FLOAT8_DTYPE", "Float8Linear", "float8_linears", "install_float8_linears", "prepare_float8_linears",
           "quantize_rows", "triton_unavailable_reason"]

FLOAT8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FLOAT8_DTYPE).max)  # 448
_EPS = 1e-12  # a row of zeros gets this maximum, so its scale is not 0 (torchao's float8 epsilon)

_TRITON = None  # (kernel, error): found on first use
_CHECKED: list = []  # the fused kernel's one check ran (`_fused_checked`)


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


def _fused_checked(device) -> bool:
    """Whether the fused kernel may run by default: once per process, on a small tensor of `device`, it must
    run and agree with the torch form (scales equal, float8 values within one rounding); where it does not,
    one warning and the torch form from then on (slower, never wrong)."""
    global _TRITON
    kernel, reason = _triton_kernel()
    if kernel is None or _CHECKED:
        return kernel is not None
    _CHECKED.append(True)
    try:
        x = torch.randn(3, 200, device=device).to(torch.bfloat16) * 5
        q, scale = quantize_rows(x, fused=True)
        q_ref, scale_ref = quantize_rows(x, fused=False)
        torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
        # one float8 step apart at most where a fused division rounds a tie the other way (e4m3: 1/8 of the
        # value, 2**-9 below its normal range)
        step = torch.clamp(q_ref.float().abs() / 8, min=2.0 ** -9)
        if not ((q.float() - q_ref.float()).abs() <= step).all():
            raise AssertionError("float8 values more than one step from the torch form's")
        return True
    except Exception as exc:  # noqa: BLE001 -- a kernel this GPU or Triton cannot run or runs wrong
        _TRITON = (None, f"the fused kernel failed its check: {type(exc).__name__}: {str(exc)[:300]}")
        logger.warning("float8 linears quantize their inputs with torch's ops (slower): %s", _TRITON[1])
        return False


def quantize_rows(x: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a 2-D tensor: ``q = clamp(x / scale)`` in float8 e4m3 and ``scale`` (float32,
    shape ``(rows, 1)``) each row's absolute maximum over 448. `fused`: the Triton kernel (default: on CUDA
    where Triton is installed), else torch's ops."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor, got shape {tuple(x.shape)}")
    if fused is None:
        fused = x.is_cuda and _fused_checked(x.device)
    kernel = _triton_kernel()[0]
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


class Float8Linear(torch.nn.Linear):
    """A linear layer in float8 (this module's form): ``weight`` float8 e4m3 (row-major, ``requires_grad``
    off), ``weight_scale`` float32 per output row, ``bias`` as the layer had it. A ``nn.Linear`` still, so
    code that looks for linear layers (LoRA's targets, `bcg.lora`) finds it."""

    def __init__(self, in_features: int, out_features: int, bias: torch.nn.Parameter | None, device=None):
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight in the default dtype
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty((out_features, in_features), dtype=FLOAT8_DTYPE, device=device),
                                         requires_grad=False)
        self.register_buffer("weight_scale", torch.empty((out_features, 1), dtype=torch.float32, device=device))
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, empty: bool = False) -> "Float8Linear":
        """`linear` in float8 (`empty`: over empty tensors, a stored state is loaded into them next)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias, device=linear.weight.device)
        if not empty:
            with torch.no_grad():
                data, scale = quantize_rows(linear.weight.detach(), fused=False)
            layer.weight = torch.nn.Parameter(data, requires_grad=False)
            layer.weight_scale = scale
        return layer.train(linear.training)

    def forward(self, x):
        shape = x.shape
        # traced by a compile, the torch form: inductor fuses it into the kernel before it, as it does torchao's
        fused = False if torch.compiler.is_compiling() else None
        q, scale = quantize_rows(x.reshape(-1, shape[-1]), fused=fused)
        bias = self.bias
        out = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale.t(),
                               bias=bias.to(torch.bfloat16) if bias is not None else None,
                               out_dtype=torch.bfloat16, use_fast_accum=True)  # as torchao's default
        return out.reshape(*shape[:-1], out.shape[-1]).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, float8 e4m3 per-row scales"


def install_float8_linears(module: torch.nn.Module, chosen: set, empty: bool = False) -> int:
    """Replace each linear layer of `module` whose ``id`` is in `chosen` by its `Float8Linear`; returns how
    many. A layer in float8 already is left as it is."""
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if id(child) in chosen and type(child) is torch.nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, Float8Linear.from_linear(child, empty=empty))
    return len(swaps)


def prepare_float8_linears(module: torch.nn.Module, names) -> int:
    """The layers of `install_float8_linears` over empty float8 tensors, for the layers named (qualified
    names): a module built from its config, about to load a stored state."""
    names = set(names)
    return install_float8_linears(module, {id(sub) for name, sub in module.named_modules() if name in names},
                                  empty=True)


def float8_linears(module: torch.nn.Module) -> list[str]:
    """Qualified names of `module`'s layers in this form."""
    return [name for name, sub in module.named_modules() if isinstance(sub, Float8Linear)]
