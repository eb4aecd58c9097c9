"""Edits from input images on a loaded pipeline: diffusers' own edit pipelines of its family, made from its
components.

A family record names the diffusers class of each edit it makes (`bcg.diffusers.families.ModelFamily.
edit_pipelines`: Flux's ``FluxImg2ImgPipeline`` for image-to-image, ``FluxInpaintPipeline`` for
inpainting). `EditPipelines` makes each from the loaded pipeline's components on first use (the same
transformer, VAE, text encoders and scheduler objects: no weights copied, an accelerated pipeline's runners
and hooks shared; the pipeline's config values the class takes too: Wan2.2 TI2V-5B's ``WanPipeline`` makes
image-to-video with ``WanImageToVideoPipeline(expand_timesteps=True)`` and no image encoder) and keeps it while
the loaded pipeline's components stay the same. It calls the class's constructor with them, as diffusers'
``from_pipe`` does, but not ``from_pipe`` itself: that ends with
``new_pipeline.to(dtype=torch_dtype or torch.float32)``, which would cast the served pipeline's shared modules
(bfloat16 weights to float32; and with a dtype given, modules a pipeline keeps in another dtype). A family whose
loaded pipeline makes the edit itself (Kontext's ``"instruction"``: ``FluxKontextPipeline``) gets the loaded
pipeline. A request's call arguments say which edit it is (`edit_kind_of`: ``image`` and ``mask_image``,
diffusers' names, and the edits the family makes).

The step hooks (`bcg.diffusers.step_batching.steps`) call these pipelines' own methods for a request's
preparation (``get_timesteps``, ``prepare_latents``) with the request's own scheduler in place of the
pipeline's (`with_scheduler`), since those methods read ``self.scheduler``.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from bcg.diffusers.families import family_of

__all__ = ["EditPipelines", "edit_kind_of", "with_scheduler"]


def edit_kind_of(kwargs: dict, edits=()) -> str | None:
    """The edit a pipeline call's arguments ask for of a family that makes `edits`: ``"inpaint"`` (an ``image``
    and a ``mask_image``), ``"instruction"`` (an ``image`` where the family makes instruction edits),
    ``"image-to-image"`` (an ``image``), None (text-to-image)."""
    from bcg.diffusers.image_inputs import edit_kind

    return edit_kind(int(kwargs.get("image") is not None), kwargs.get("mask_image") is not None, edits)


class EditPipelines:
    """The edit pipelines of loaded pipelines, made from their components on first use (a few ms) and kept
    while the loaded pipeline's components are the same objects."""

    def __init__(self):
        self._made: dict[str, tuple[Any, Any]] = {}  # kind -> (the loaded pipeline, its edit pipeline)

    def get(self, pipe, kind: str | None):
        """`pipe` itself for `kind` None, else the pipeline of its family that makes `kind`; ValueError
        naming the edits it makes where it makes no such edit."""
        if kind is None:
            return pipe
        made = self._made.get(kind)
        if made is not None and made[0] is pipe and _same_components(pipe, made[1]):
            return made[1]
        name = family_of(pipe).edit_pipelines.get(kind)
        if name is None:
            edits = sorted(family_of(pipe).edit_pipelines)
            raise ValueError(f"{type(pipe).__name__} cannot do {kind}: its family makes "
                             f"{', '.join(edits) if edits else 'no edits from input images'}")
        if name in {cls.__name__ for cls in type(pipe).__mro__}:
            return pipe  # the loaded pipeline makes this edit itself (Kontext)
        edit = _from_components(getattr(importlib.import_module("diffusers"), name), pipe)
        progress = getattr(pipe, "_progress_bar_config", None)
        if progress is not None:
            edit.set_progress_bar_config(**progress)
        self._made[kind] = (pipe, edit)
        return edit


def _from_components(cls, pipe):
    """``cls`` built on `pipe`'s components and config (its constructor's modules and the config values it takes,
    Wan's ``expand_timesteps`` and ``boundary_ratio``; those `pipe` lacks left to their defaults), modules
    untouched."""
    parameters = inspect.signature(cls.__init__).parameters
    config = getattr(pipe, "config", None)
    values = {k: v for k, v in config.items() if not k.startswith("_")} if hasattr(config, "items") else {}
    components = {**values, **pipe.components}
    missing = [name for name, p in parameters.items() if name != "self" and p.default is inspect.Parameter.empty
               and name not in components]
    if missing:
        raise ValueError(f"{cls.__name__} needs components {missing} that {type(pipe).__name__} does not have")
    return cls(**{name: components[name] for name in parameters if name in components})


def _same_components(pipe, edit) -> bool:
    return all(getattr(edit, name, None) is value for name, value in pipe.components.items()
               if hasattr(edit, name))


class _WithScheduler:
    """`pipeline` as its own methods see it, but for ``scheduler``: a request's own."""

    def __init__(self, pipeline, scheduler):
        self._pipeline = pipeline
        self.scheduler = scheduler

    def __getattr__(self, name):
        return getattr(self._pipeline, name)


def with_scheduler(pipeline, scheduler) -> Any:
    """`pipeline` with `scheduler` in place of its own, for calling its methods that read ``self.scheduler``
    (``get_timesteps``, ``prepare_latents``) unbound: ``type(pipeline).get_timesteps(view, ...)``. The
    pipeline and its scheduler are left as they were."""
    return _WithScheduler(pipeline, scheduler)
