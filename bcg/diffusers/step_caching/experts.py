"""Step caching on a pipeline of several transformers: `StepCaches`, what `enable_step_cache` and
`step_cache_of` return for a pipeline whose ``transformer_2`` is hooked beside its ``transformer``.

Wan2.2's A14B models (``WanPipeline``, ``WanImageToVideoPipeline`` with ``boundary_ratio``) denoise with two
experts: ``transformer`` while the timestep is at or above ``boundary_ratio`` times the scheduler's training
timesteps, ``transformer_2`` after. Each transformer has a step-cache hook of its own (its blocks, its stored
residuals), and the hooks count one request's steps together: a request's step is the pipeline's step, whichever
transformer runs it, so a ``schedule`` names the request's steps. The first step after the switch always
computes (the second expert has no residual of that request yet: cache-dit's cache context per expert does the
same), so a threshold-0 request equals an uncached one and a schedule computes at least one step per expert.

`StepCaches` is the face those callers of one hook use (the step batcher, the serving engine): the default
`config`, the row `buckets`, `plain_request` (one count of computed and cached steps over the transformers),
`stats` (summed; each transformer's under ``"transformers"``) and `middle_runners` (each transformer's middle
blocks' runner: ``middle_blocks``, ``middle_blocks_2``). Torch only through the hooks it holds.
"""
from __future__ import annotations

import contextlib

__all__ = ["StepCaches"]


class StepCaches:
    """The step-cache hooks of a pipeline's transformers, by slot name (``{"transformer": hook,
    "transformer_2": hook}``), the first one's settings the default of all (see the module docstring)."""

    def __init__(self, hooks: dict):
        if len(hooks) < 2:
            raise ValueError("StepCaches holds the hooks of two transformers or more")
        self.hooks = dict(hooks)
        first, *others = self.hooks.values()
        for hook in others:
            hook.share_steps(first)

    @property
    def config(self):
        """The default config of rows no caller describes (the same on every transformer)."""
        return next(iter(self.hooks.values())).config

    @config.setter
    def config(self, value) -> None:
        for hook in self.hooks.values():
            hook.config = value

    @property
    def buckets(self) -> tuple:
        return next(iter(self.hooks.values())).buckets

    @contextlib.contextmanager
    def plain_request(self, config=None):
        """Around one ``pipe(...)`` call: every transformer's rows cache with `config`; yields one
        ``{"computed": n, "cached": n}`` of the request's steps on all of them."""
        counts = {"computed": 0, "cached": 0}
        with contextlib.ExitStack() as stack:
            for hook in self.hooks.values():
                stack.enter_context(hook.plain_request(config, counts=counts))
            yield counts

    def middle_runners(self) -> dict:
        """Each transformer's middle-blocks runner, named after its slot (``middle_blocks``, ``middle_blocks_2``)."""
        return {f"middle_blocks{name.removeprefix('transformer')}": runner
                for name, hook in self.hooks.items() for runner in hook.middle_runners().values()}

    def reset(self) -> None:
        for hook in self.hooks.values():
            hook.reset()

    def stats(self) -> dict:
        """The hooks' counters summed (row buckets merged), the first one's settings, and each transformer's
        own stats under ``"transformers"``."""
        each = {name: hook.stats() for name, hook in self.hooks.items()}
        out = dict(next(iter(each.values())))
        for key, value in out.items():
            if isinstance(value, int) and not isinstance(value, bool) and key not in ("first_blocks", "last_blocks"):
                out[key] = sum(s[key] for s in each.values())
        buckets: dict = {}
        for s in each.values():
            for bucket, calls in s["middle_buckets"].items():
                buckets[bucket] = buckets.get(bucket, 0) + calls
        out["middle_buckets"] = dict(sorted(buckets.items()))
        out["transformers"] = each
        return out
