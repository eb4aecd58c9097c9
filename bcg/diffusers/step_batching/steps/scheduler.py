"""Each request's scheduler step after a batched forward, the steps of requests at the same point of one
flow-matching schedule fused into one elementwise call (bit for bit their own steps)."""
from __future__ import annotations

import torch

from bcg.diffusers.step_batching.steps.state import RequestState

__all__ = ["fused_step_key", "scheduler_step", "shallow_copyable"]


def scheduler_step(states: list[RequestState], noise: list[torch.Tensor]) -> list[BaseException | None]:
    """Each state's scheduler step with its noise prediction (latents and step index advanced); per
    state None, or the exception its own step raised (its state then as before).

    Where states are at the same point of one prepared flow-matching schedule (`fused_step_key`: the
    same sigmas tensor, step index and dtypes), their steps run as one: the scheduler's own
    expression, ``(sample.float() + dt * noise).to(noise.dtype)`` with the same 0-dim ``dt`` tensor,
    on their rows concatenated. Elementwise, so each row's result is the one its own step makes, bit
    for bit, with a few kernel launches a step instead of a few per request. A fused step that
    raises is retried per state.
    """
    errors: list[BaseException | None] = [None] * len(states)
    groups: dict = {}
    for i, (state, pred) in enumerate(zip(states, noise)):
        key = fused_step_key(state, pred)
        groups.setdefault(("alone", i) if key is None else key, []).append(i)
    for members in groups.values():
        if len(members) > 1:
            try:
                fused_step([states[i] for i in members], [noise[i] for i in members])
                continue
            except Exception:  # noqa: BLE001 -- each alone below says whose it is
                pass
        for i in members:
            state = states[i]
            try:
                state.latents = state.scheduler.step(noise[i], state.timestep, state.latents,
                                                     return_dict=False)[0]
                state.step_index += 1
            except Exception as exc:  # noqa: BLE001
                errors[i] = exc
    return errors


def shallow_copyable(scheduler) -> bool:
    """FlowMatchEulerDiscreteScheduler: `set_timesteps` and `step` only rebind its attributes (see
    `StepFamily._scheduler`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return type(scheduler) is FlowMatchEulerDiscreteScheduler


def fused_step_key(state: RequestState, noise: torch.Tensor) -> tuple | None:
    """What states must share for `fused_step`, None where the step must be the scheduler's own: a
    FlowMatchEulerDiscreteScheduler (exactly) at a known step index, deterministic, its latents and
    prediction of one shape and dtype per row."""
    scheduler = state.scheduler
    if not shallow_copyable(scheduler) or scheduler.config.get("stochastic_sampling", False):
        return None
    index = _next_index(scheduler)
    if index is None or index + 1 >= len(scheduler.sigmas) or state.latents.shape != noise.shape:
        return None
    return ("flow", id(scheduler.sigmas), index, state.latents.dtype, noise.dtype, tuple(noise.shape[1:]),
            noise.device)


def _next_index(scheduler) -> int | None:
    """The sigma index the scheduler's next step uses: its step index, before the first step its begin
    index (None: the scheduler would find it from the timestep)."""
    return scheduler.step_index if scheduler.step_index is not None else scheduler.begin_index


def fused_step(states: list[RequestState], noise: list[torch.Tensor]) -> None:
    """``FlowMatchEulerDiscreteScheduler.step`` (deterministic, no per-token timesteps) of states that share
    a `fused_step_key`, on their rows at once; see `StepFamily.scheduler_step`."""
    first = states[0].scheduler
    index = _next_index(first)
    dt = first.sigmas[index + 1] - first.sigmas[index]  # the scheduler's own 0-dim tensor, as it makes it
    sample = torch.cat([s.latents for s in states]).to(torch.float32)
    prev = (sample + dt * torch.cat(noise)).to(noise[0].dtype)
    offset = 0
    for state in states:
        state.latents = prev[offset:offset + state.latents.shape[0]]
        offset += state.latents.shape[0]
        state.scheduler._step_index = index + 1  # as the scheduler's step leaves it
        state.step_index += 1
