"""Step batching: requests of one group share each transformer call, joining and leaving at step boundaries.

- `batcher`: `StepBatcher`, the loop (rows laid out per call, one `RowsContext` around each call);
- `queue`: `BatcherConfig` and the queue policy (who joins a running batch, when);
- `costs`: `StepCosts` and `joining_rows`, the ``"auto"`` admission rule (torch-free);
- `warmup`, `stats`: the batcher's warmup plan and capture of every row bucket; its counters;
- `steps/`: the step hooks per family (`StepFamily` and one module per family).

Names are re-exported lazily, so importing `costs` or `queue` does not import the batcher.
"""
from bcg._lazy import lazy_exports

_EXPORTS = {
    "StepBatcher": "bcg.diffusers.step_batching.batcher",
    "BatcherConfig": "bcg.diffusers.step_batching.queue",
    "StepCosts": "bcg.diffusers.step_batching.costs",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
