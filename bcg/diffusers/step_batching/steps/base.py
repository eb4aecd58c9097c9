"""The base of the step families (`bcg.diffusers.step_batching.steps` states their contract): `StepFamily` and the
prompt helpers every family shares.

`StepFamily.prepare_batch` prepares the requests that join at one step boundary: every request's input
checks, latents (from its own generator) and scheduler are its own, as in the pipeline, while their
prompts go through one ``encode_prompt`` call. An edit's arguments (``image``, ``mask_image``,
``strength``) are those of its family's edit pipeline (`call_pipeline`), whose defaults it gets. A subclass says what that takes: which call arguments
hold prompts (`prompt_fields`), the settings two requests must share to share an encode
(`_encode_settings`), the encode itself (`_encode`) and the rest of one request's preparation (`_state`).
"""
from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from bcg.diffusers.call_args import call_defaults
from bcg.diffusers.edits import EditPipelines, edit_kind_of, with_scheduler
from bcg.diffusers.families import family_named
from bcg.diffusers.step_batching.steps.postprocess import postprocess_async
from bcg.diffusers.step_batching.steps.scheduler import scheduler_step, shallow_copyable
from bcg.diffusers.step_batching.steps.state import RequestState, cat_rows, keep_unmasked
from bcg.runtime.rows import call_branch

__all__ = ["EditStart", "StepFamily", "branch_context", "guided", "prompt_columns"]


class EditStart(NamedTuple):
    """Where an edit from an input image starts (`StepFamily._edit_start`): its edit pipeline, that pipeline as
    its own methods must see it for this request (`view`: the request's scheduler in place of its own), the
    input image preprocessed to the request's size, the timesteps it runs and their start in the full schedule."""
    pipeline: Any
    view: Any
    image: torch.Tensor
    timesteps: torch.Tensor
    start_step: int


@contextlib.contextmanager
def branch_context(transformer, branch: str):
    """Around a transformer call of one CFG `branch` (``"cond"`` / ``"uncond"``): diffusers' cache hooks read
    it from the transformer's cache context (keyed by it, as the pipeline enters it), bcg's from the rows
    context (`call_branch`)."""
    enter = getattr(transformer, "cache_context", None)
    with (enter(branch) if enter is not None else contextlib.nullcontext()), call_branch(transformer, branch):
        yield


def guided(states, cond: torch.Tensor, uncond: torch.Tensor | None) -> list[torch.Tensor]:
    """Each state's rows of the batched prediction, with CFG at its own scale (the pipelines' formula)."""
    noise, offset = [], 0
    for s in states:
        pred = cond[offset:offset + s.rows]
        if uncond is not None:
            neg = uncond[offset:offset + s.rows]
            pred = neg + s.guidance_scale * (pred - neg)
        noise.append(pred)
        offset += s.rows
    return noise


def _hashable(value):
    """A cache key part for a scheduler argument (sigmas come as numpy arrays or lists)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return tuple(float(x) for x in np.asarray(value, dtype=np.float64).ravel())


def prompt_columns(fields: dict, broadcast_negatives: bool = False) -> dict[str, list] | None:
    """Prompt fields as lists of one length (the prompts'), None when they are not: a list of another
    length, or a string beside several prompts (a negative string is repeated where the pipeline does)."""
    prompt = fields["prompt"]
    if not isinstance(prompt, (str, list)) or not prompt:
        return None
    count = len(prompt) if isinstance(prompt, list) else 1
    columns = {}
    for name, value in fields.items():
        if isinstance(value, str):
            value = [value] * (count if broadcast_negatives and name.startswith("negative") else 1)
        if not isinstance(value, list) or len(value) != count:
            return None
        columns[name] = value
    return columns


def _generators(value) -> list[torch.Generator]:
    return [g for g in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(g, torch.Generator)]


def _split_rows(rows: dict, prompts: list[int], per_prompt: list[int]) -> list[dict]:
    """Each request's rows of one encode over all their prompts (padding rows left out), each prompt's
    row repeated per image: the layout of ``encode_prompt(num_images_per_prompt=k)`` (prompt-major).

    Rows of one image per prompt are views: the joint tensors (padding rows too; ``encode_prompt``'s own
    copies, never a runner's static outputs) live until the last request holding a view leaves."""
    out, offset = [], 0
    for count, k in zip(prompts, per_prompt):
        part = {name: t[offset:offset + count] for name, t in rows.items()}
        out.append(part if k == 1 else {name: t.repeat_interleave(k, dim=0) for name, t in part.items()})
        offset += count
    return out


class StepFamily:
    """Base of a family's step hooks; subclasses implement the preparation parts (see the module
    docstring), `forward` and `decode_latents` (or `decode_rows`)."""

    name = "generic"
    # call arguments a step-wise run honours; a request with any other argument runs alone
    batch_args: frozenset = frozenset()
    # the call arguments that hold prompts, in the order `_encode` reads them
    prompt_fields: tuple[str, ...] = ("prompt",)

    def batchable(self, kwargs: dict) -> str | None:
        """None when `kwargs` can run step-wise, else the reason it runs alone."""
        extra = sorted(k for k, v in kwargs.items() if k not in self.batch_args and v is not None)
        return f"arguments {extra} are not step-batched" if extra else None

    # preparation -------------------------------------------------------------------------------------

    def prepare(self, pipe, kwargs: dict) -> RequestState:
        """One request's state, everything the pipeline does before its loop (no padded prompts)."""
        return self.prepare_batch(pipe, [kwargs])[0]

    def encode_group(self, pipe, kwargs: dict) -> tuple[tuple, int] | None:
        """``(settings, prompts)``: requests with equal settings can share one `prepare_batch`, which
        encodes their prompts (``prompts`` of this one) in one call; None: prepare this one alone."""
        a = self._args(pipe, kwargs)
        columns = self._columns(a)
        return None if columns is None else (self._encode_settings(a), len(columns["prompt"]))

    def prepare_batch(self, pipe, kwargs_list: list[dict], bucket: int | None = None) -> list[RequestState]:
        """The states of several requests (in order) whose prompts are encoded in one ``encode_prompt``
        call, padded to `bucket` prompts by repeating the last (None: not padded), so the text encoders
        see the batch sizes a warmup captured. The rows never mix: each request gets its own prompts'
        rows, the same values up to the rounding of batched kernels. One request with `bucket` None (or
        its prompt count) is the pipeline's preparation exactly. Requests with different `encode_group`
        settings raise ValueError; any request's error raises, with every request's generator put back
        as it was, so that the caller's retry of each alone draws the same latents.
        """
        args = [self._args(pipe, kwargs) for kwargs in kwargs_list]
        generators = [g for a in args for g in _generators(a.get("generator"))]
        saved = [(g, g.get_state()) for g in generators]
        try:
            return self._prepare_batch(pipe, args, bucket)
        except BaseException:
            for generator, state in saved:  # a request before the culprit drew its latents already
                generator.set_state(state)
            raise

    def _prepare_batch(self, pipe, args: list[dict], bucket: int | None) -> list[RequestState]:
        for a in args:
            self._check(pipe, a)
        device = pipe._execution_device
        columns = [self._columns(a) for a in args]
        if len(args) == 1 and columns[0] is None:
            # prompt fields of unequal lengths: the pipeline's own encode says what they mean
            a = args[0]
            rows, shared = self._encode(pipe, a, {f: a.get(f) for f in self.prompt_fields}, self._per_prompt(a),
                                        device)
            per_request = [rows]
        else:
            if None in columns or len({self._encode_settings(a) for a in args}) > 1:
                raise ValueError("these requests cannot share one prompt encode (their encode_group differs); "
                                 "prepare each with prepare()")
            prompts = [len(c["prompt"]) for c in columns]
            joint = {}
            for name in columns[0]:
                flat = [p for c in columns for p in c[name]]
                joint[name] = flat + flat[-1:] * max(0, (bucket or 0) - len(flat))
            rows, shared = self._encode(pipe, args[0], joint, 1, device)
            per_request = _split_rows(rows, prompts, [self._per_prompt(a) for a in args])
        return [self._state(pipe, a, r, shared, device) for a, r in zip(args, per_request)]

    def _check(self, pipe, a: dict) -> None:
        """The pipeline's input checks of one request."""
        raise NotImplementedError

    def _cfg(self, a: dict) -> bool:
        """Whether the request runs a negative branch: the family's one CFG rule (`CfgRule.runs`)."""
        return family_named(self.name).cfg.runs(a)

    def _encode_settings(self, a: dict) -> tuple:
        """What requests must share to share an encode (sequence length, CFG, ...)."""
        raise NotImplementedError

    def _columns(self, a: dict) -> dict[str, list] | None:
        """The request's prompt fields as lists of its prompt count (`prompt_columns`), None when they
        are not (then it is prepared alone, its fields as given)."""
        raise NotImplementedError

    def _encode(self, pipe, a: dict, prompts: dict, per_prompt: int, device) -> tuple[dict, dict]:
        """``encode_prompt`` of `prompts` (`prompt_fields` -> values): ``(rows, shared)``, rows the batch
        tensors by `_state`'s names, shared those that are not per row."""
        raise NotImplementedError

    def _state(self, pipe, a: dict, rows: dict, shared: dict, device) -> RequestState:
        """The rest of one request's preparation (latents, scheduler, timesteps) from its encoded rows."""
        raise NotImplementedError

    # the loop ----------------------------------------------------------------------------------------

    def forward(self, pipe, states: list[RequestState], bucket: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def row_owners(self, states: list[RequestState], bucket: int) -> list[int]:
        """Which state (its index) each row of `forward`'s transformer call belongs to: the states' rows
        side by side, padding rows repeating the last (a LoRA adapter per row follows it: `bcg.lora`)."""
        owners = [i for i, s in enumerate(states) for _ in range(s.rows)]
        return owners + owners[-1:] * max(0, bucket - len(owners))

    def row_branches(self, states: list[RequestState], bucket: int) -> list[str]:
        """The CFG branch of each row of `forward`'s transformer call, beside `row_owners`: ``"cond"`` for
        every row (a family whose negative rows share the call says otherwise: SD3)."""
        return ["cond"] * len(self.row_owners(states, bucket))

    def decode_latents(self, pipe, latents: torch.Tensor, state: RequestState) -> torch.Tensor:
        """The VAE's images of `latents` (rows of requests laid out like `state`'s), before post-processing."""
        raise NotImplementedError

    def decode_rows(self, pipe, states: list[RequestState], bucket: int) -> torch.Tensor:
        """The VAE's images of `states`' final latents side by side, padded to `bucket` rows: `decode_latents` of
        their rows (a family whose edit pipeline decodes otherwise than its text pipeline overrides this: SD3)."""
        return self.decode_latents(pipe, cat_rows([s.latents for s in states], bucket), states[0])

    def finish(self, pipe, state: RequestState) -> list:
        """The request's outputs (a list of its images) from its final latents, as the pipeline makes them."""
        return self.finish_batch(pipe, [state], state.rows)[0]

    def finish_batch(self, pipe, states: list[RequestState], bucket: int) -> list[list]:
        """`finish` of several requests with one VAE decode over their rows, padded to `bucket` rows.

        A VAE's rows never mix either (convolutions and its mid-block attention are per image), so each
        request's images differ from `finish` alone only by the rounding of batched kernels; one request
        with `bucket` equal to its rows is `finish` exactly.
        """
        return self.finish_batch_async(pipe, states, bucket)()

    def finish_batch_async(self, pipe, states: list[RequestState], bucket: int) -> Callable[[], list[list]]:
        """`finish_batch` in two halves (`postprocess_async`): this call queues the decode; the function
        it returns makes each request's outputs once the device is done (any thread)."""
        output_type = states[0].output_type
        if any(s.output_type != output_type for s in states[1:]):
            out = [self.finish(pipe, s) for s in states]
            return lambda: out
        if output_type == "latent":
            out = [list(s.latents) for s in states]
            return lambda: out
        rows = sum(s.rows for s in states)
        image = self.decode_rows(pipe, states, bucket)
        images = postprocess_async(pipe.image_processor, image[:rows] if bucket > rows else image, output_type)
        counts = [s.rows for s in states]

        def outputs() -> list[list]:
            flat, out, offset = images(), [], 0
            for count in counts:
                out.append(flat[offset:offset + count])
                offset += count
            return out

        return outputs

    def step(self, pipe, states: list[RequestState], bucket: int | None = None) -> None:
        """One denoising step of every state: one batched `forward`, then each state's scheduler step."""
        rows = sum(s.rows for s in states)
        for error in self.scheduler_step(states, self.forward(pipe, states, max(bucket or rows, rows))):
            if error is not None:
                raise error

    def scheduler_step(self, states: list[RequestState], noise: list[torch.Tensor]) -> list[BaseException | None]:
        """Each state's scheduler step with its noise prediction (see `bcg.diffusers.step_batching.steps.scheduler`),
        then, for an inpainting request, its mask applied to its own rows (`keep_unmasked`)."""
        errors = scheduler_step(states, noise)
        for i, state in enumerate(states):
            if errors[i] is None and state.inpaint is not None:
                try:
                    keep_unmasked(state)
                except Exception as exc:  # noqa: BLE001 -- its own error
                    errors[i] = exc
        return errors


    # shared helpers --------------------------------------------------------------------------------

    def call_pipeline(self, pipe, kwargs: dict):
        """The pipeline whose ``__call__`` a request's arguments are for: `pipe`, or for an edit (``image``,
        ``mask_image``: `bcg.diffusers.edits`) diffusers' edit pipeline of its family made from `pipe`'s
        components, kept by these hooks."""
        kind = edit_kind_of(kwargs, family_named(self.name).edit_pipelines)
        if kind is None:
            return pipe
        edits = getattr(self, "_edit_pipelines", None)
        if edits is None:
            edits = self._edit_pipelines = EditPipelines()
        return edits.get(pipe, kind)

    def _edit_start(self, pipe, a: dict, scheduler, device) -> EditStart:
        """An edit's start as its edit pipeline (`call_pipeline`) makes it with its own methods: the input image
        preprocessed to the request's size (float32), the timesteps ``get_timesteps`` leaves of `scheduler`'s full
        schedule at the request's ``strength`` (it sets the scheduler's begin index: the request's own scheduler,
        through `with_scheduler`); ValueError where the strength leaves no step to run."""
        edit = self.call_pipeline(pipe, a)
        image = edit.image_processor.preprocess(a["image"], height=a["height"], width=a["width"])
        view = with_scheduler(edit, scheduler)  # its methods read self.scheduler: the request's own
        steps = a["num_inference_steps"]
        timesteps, run = type(edit).get_timesteps(view, steps, a["strength"], device)
        if run < 1:
            raise ValueError(f"strength {a['strength']} leaves {run} of {steps} steps to run; raise strength or "
                             "num_inference_steps")
        return EditStart(edit, view, image.to(dtype=torch.float32), timesteps, steps - run)

    @staticmethod
    def _latent_mask(edit, a: dict, size: tuple[int, int], count: int, dtype, device) -> torch.Tensor:
        """An inpainting request's mask as its pipeline's ``prepare_mask_latents`` makes it: diffusers' mask
        processor at the request's size, interpolated to the latents' `size` ``(height, width)``, one per row of
        its `count`. (The masked image's latents it also makes, a VAE encode, feed only inpainting transformers
        with extra input channels, which these hooks do not step: the loops of the pipelines served never read
        them.)"""
        mask = edit.mask_processor.preprocess(a["mask_image"], height=a["height"], width=a["width"])
        mask = torch.nn.functional.interpolate(mask, size=size).to(device=device, dtype=dtype)
        if mask.shape[0] < count:
            mask = mask.repeat(count // mask.shape[0], 1, 1, 1)
        return mask

    def _args(self, pipe, kwargs: dict) -> dict:
        """The request's call arguments over its pipeline's defaults (`call_pipeline`'s: an edit's
        ``strength`` and guidance are its edit pipeline's), its height and width resolved."""
        a = call_defaults(self.call_pipeline(pipe, kwargs)) | kwargs
        a["height"] = a.get("height") or pipe.default_sample_size * pipe.vae_scale_factor
        a["width"] = a.get("width") or pipe.default_sample_size * pipe.vae_scale_factor
        return a

    def _flow_timesteps(self, pipe, a: dict, seq_len: int, device, fallback_module: str):
        """``(scheduler, timesteps)`` of a flow-matching pipeline's full schedule (Flux, Qwen-Image): sigmas
        from 1 to 1/steps, shifted by ``calculate_shift`` of the image's `seq_len` tokens, through the
        pipeline module's ``retrieve_timesteps``."""
        steps = a["num_inference_steps"]
        sigmas = np.linspace(1.0, 1 / steps, steps) if a.get("sigmas") is None else a["sigmas"]
        config = pipe.scheduler.config
        if getattr(config, "use_flow_sigmas", False):
            sigmas = None
        mu = self._pipeline_function(pipe, "calculate_shift", fallback_module)(
            seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        retrieve = self._pipeline_function(pipe, "retrieve_timesteps", fallback_module)
        return self._scheduler_at(pipe, retrieve, steps, device, sigmas=sigmas, mu=mu)

    def _vae_device(self, pipe):
        """diffusers' ``get_module_execution_device(pipe.vae)``, asked again only when the VAE object or its
        first tensor's device changed (the question walks every submodule for offload hooks: ~1.6 ms)."""
        from diffusers.utils.torch_utils import get_module_execution_device

        from bcg.diffusers.accelerated import first_tensor_device
        from bcg.runtime.proxy import unwrap_runner

        vae = pipe.vae
        # its first tensor's device, found without a walk (``vae.device`` walks every submodule for group
        # offloading hooks first: 1.5 ms a decode)
        seen = (vae, first_tensor_device(unwrap_runner(vae)))
        cached = getattr(self, "_vae_device_seen", None)
        if cached is None or cached[0][0] is not vae or cached[0][1] != seen[1]:
            cached = self._vae_device_seen = (seen, get_module_execution_device(vae))
        return cached[1]

    @staticmethod
    def _pipeline_function(pipe, name: str, fallback_module: str) -> Callable:
        """`name` (``retrieve_timesteps``, ``calculate_shift``) from the module of the pipeline's class."""
        for cls in type(pipe).__mro__:
            module = sys.modules.get(cls.__module__)
            if module is not None and hasattr(module, name):
                return getattr(module, name)
        return getattr(__import__(fallback_module, fromlist=[name]), name)

    def _scheduler(self, pipe):
        """A scheduler of the request's own (timesteps, sigmas, step index), as fresh as ``from_config``.

        Copied from a pristine template (``from_config`` costs 0.4 ms, a shallow copy 5 us). Shallow for
        FlowMatchEulerDiscreteScheduler, whose `set_timesteps` and `step` only rebind its attributes (the
        template's tensors are never written in place); deep for any other class, whose state may be
        lists updated in place (multistep schedulers).
        """
        template = self._template(pipe)
        return copy.copy(template) if shallow_copyable(template) else copy.deepcopy(template)

    def _template(self, pipe):
        """The pristine scheduler `_scheduler` copies: a ``from_config`` of the pipeline's, made again when
        the pipeline's scheduler object changes."""
        source, template = getattr(self, "_scheduler_template", (None, None))
        if source is not pipe.scheduler:
            template = type(pipe.scheduler).from_config(pipe.scheduler.config)
            self._scheduler_template = (pipe.scheduler, template)
        return template

    def _scheduler_at(self, pipe, retrieve: Callable, steps: int, device, **kwargs):
        """``(scheduler, timesteps)``: a scheduler of the request's own with its timesteps set, as
        ``retrieve(scheduler, steps, device, **kwargs)`` (the pipeline's ``retrieve_timesteps``) sets them.

        For FlowMatchEulerDiscreteScheduler the scheduler so prepared is kept per arguments and each request
        gets a shallow copy (`_scheduler` says why that is safe): the same tensors `set_timesteps` would
        build again, without its host-to-device copies per request (a copy from pageable host memory
        waits for the device's queue). Any other class: a fresh `_scheduler` and its own ``retrieve``.
        """
        source = self._template(pipe)  # a new pipeline scheduler: a new template, a new cache
        if not shallow_copyable(source):
            scheduler = self._scheduler(pipe)
            timesteps, _ = retrieve(scheduler, steps, device, **kwargs)
            return scheduler, timesteps
        owner, cache = getattr(self, "_prepared_schedulers", (None, {}))
        if owner is not source or len(cache) >= 64:  # distinct step counts and shifts are few
            cache = {}
            self._prepared_schedulers = (source, cache)
        key = (steps, str(device), tuple(sorted((k, _hashable(v)) for k, v in kwargs.items())))
        prepared = cache.get(key)
        if prepared is None:
            scheduler = copy.copy(source)
            timesteps, _ = retrieve(scheduler, steps, device, **kwargs)
            prepared = cache[key] = (scheduler, timesteps)
        return copy.copy(prepared[0]), prepared[1]

    @staticmethod
    def _per_prompt(a: dict) -> int:
        return int(a.get("num_images_per_prompt") or 1)

    @classmethod
    def _rows(cls, a: dict) -> int:
        prompt = a.get("prompt")
        return (len(prompt) if isinstance(prompt, list) else 1) * cls._per_prompt(a)
