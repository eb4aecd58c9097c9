"""Step-wise batching hooks of the flow-matching pipelines: requests prepared together, one batched step, decode.

`StepBatcher` (`bcg.diffusers.step_batching.batcher`) drives a denoising loop in which every request keeps its own
state, and rows of several requests share each transformer call. What that needs from a family is what a
pipeline's ``__call__`` does, cut at the step boundary:

- `StepFamily.prepare_batch(pipe, kwargs_list, bucket) -> [RequestState]`: everything before the loop
  for the requests that join at one step boundary, with the pipeline's own methods in the pipeline's
  order: each request's input checks, then *one* ``encode_prompt`` call over all their prompts (Flux's
  true-CFG negatives in a second one, as the pipeline makes them) padded to `bucket` prompts by repeating
  the last, each request taking its own prompts' rows (repeated per image); then each request's latents
  from its own generator and timesteps on a scheduler of its own (a copy of a fresh ``from_config`` of
  the pipeline's). `StepFamily.encode_group(pipe, kwargs)` says which requests can share one call
  (equal sequence length, CFG, clip skip) and how many prompts a request brings; `prepare(pipe, kwargs)`
  is one request, unpadded;
- `StepFamily.forward(pipe, states, bucket) -> [noise per state]`: one transformer call (two for Flux's
  true CFG, as the pipeline makes them) on the states' rows concatenated, each row at its own timestep,
  padded to `bucket` rows by repeating the last real row; guidance applied per request with its own scale;
  `StepFamily.row_owners` / `row_branches` say whose each row of that call is and its CFG branch (the
  batcher's `bcg.runtime.rows.RowsContext` around it; a family calling once per branch narrows it per call
  with `bcg.runtime.rows.call_branch`);
- `StepFamily.finish(pipe, state) -> list`: what the pipeline does after its loop, for one request
  (decode and post-process); `finish_batch` decodes the requests that leave at one step together (their
  rows padded to a bucket: the VAE decoder's graphs per bucket come from the same warmup);
  `StepFamily.scheduler_step(states, noise)` is each request's scheduler step (those at the same point
  of one flow-matching schedule in one elementwise call, bit for bit their own steps), and
  `StepFamily.step(pipe, states, bucket)` is `forward` plus `scheduler_step` (the
  `bcg.diffusers.families.BatchingHooks` shape; the batcher calls `forward` itself so that a failed
  batched call can be retried per request).

Neither a transformer's nor a text encoder's rows mix (per-row norms, per-row attention, per-row timestep
and guidance embeddings; the tokenizers pad every prompt to a fixed length), so a row's result does not
depend on the rows beside it — up to the rounding of batched kernels, which may block a matmul differently
for another row count. A request alone (one prompt bucket, one row bucket) is the pipeline's own call,
input for input: bitwise the image of ``pipe(**kwargs)``.

Transformer inputs are built exactly as the pipeline builds them (dtypes, ``joint_attention_kwargs``), so a
batch of b rows has the transformer signature of ``pipe(..., num_images_per_prompt=b)``, and an encode of b
prompts the text-encoder signatures of ``pipe(prompt=[...] * b)``: `StepBatcher.warmup` runs shape key
``<size>.b<b>`` through `warmup_pipeline` with b prompts (``batched_prompts``), which captures both.

The package: `state` (`RequestState`, row helpers), `postprocess` (images in two halves), `alone` (the
run-alone path, `pipeline_call_async`), `scheduler` (each request's scheduler step, fused where they
share a schedule), `base` (`StepFamily`), and one module per family on that base: ``FluxPipeline``
(`flux`: guidance embedding per row; true CFG as a second call) and ``StableDiffusion3Pipeline``
(`sd3`: CFG rows ``[negatives; positives]`` in one call, each half padded to the bucket). A new family
is a module of its own beside them, which its record's ``batching`` names (``"module:Class"``; re-exporting
it here is optional). A pipeline's hooks are found through its family record only:
``bcg.diffusers.families.family_of(pipe).batching_hooks()``. Requests with arguments outside
`StepFamily.batch_args` (IP-adapters, callbacks, SD3's skip-layer guidance, precomputed embeddings) are not
batchable: `StepFamily.batchable` says so and the batcher runs them alone through ``pipe(**kwargs)``, as it
runs every request of a pipeline without a family here.
"""
from bcg.diffusers.step_batching.steps.alone import pipeline_call_async
from bcg.diffusers.step_batching.steps.base import StepFamily
from bcg.diffusers.step_batching.steps.flux import FluxStepFamily
from bcg.diffusers.step_batching.steps.postprocess import postprocess_async
from bcg.diffusers.step_batching.steps.sd3 import SD3StepFamily
from bcg.diffusers.step_batching.steps.state import RequestState, pad_rows

__all__ = ["FluxStepFamily", "RequestState", "SD3StepFamily", "StepFamily", "pad_rows", "pipeline_call_async",
           "postprocess_async"]
