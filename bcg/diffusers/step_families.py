"""The step families under their earlier import path; they live in `bcg.diffusers.steps`, which states
their contract."""
from bcg.diffusers.steps import FluxStepFamily, RequestState, SD3StepFamily, StepFamily, pad_rows

__all__ = ["FluxStepFamily", "RequestState", "SD3StepFamily", "StepFamily", "pad_rows"]
