"""`unaccelerate(pipe)` undoes `accelerate(pipe)`: the pipeline computes what it computed before, bit for bit,
and nothing of bcg is left on the pipeline, its components or any of their modules (walked)."""
import numpy as np
import pytest
import torch

from bcg.diffusers import accelerate, plan_request, unaccelerate
from bcg.diffusers.models import load_pipeline
from bcg.runtime.config import RunnerConfig, TransformerOptions
from bcg.runtime.hooks import REGISTRY_ATTR, HookRegistry, bcg_hooks_on

ALL = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder")


def _components(pipe, names):
    return [c for c in names if c == "vae_decoder" or getattr(pipe, c, None) is not None]


def _run(pipe):
    _, kwargs = plan_request(pipe, "a red cube on a table", size="64x64", steps=2, seed=11, output_type="np")
    return np.asarray(pipe(**kwargs).images)


def _objects(pipe):
    """The pipeline, every component and every submodule of the module components."""
    out = {"pipe": pipe}
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            out.update({f"{name}.{sub_name}": sub for sub_name, sub in component.named_modules()})
        elif component is not None:
            out[name] = component
    return out


def _snapshot(pipe):
    """Per module: its instance attributes (name -> identity) and its processor; per other object (the
    pipeline, tokenizers, scheduler: their state changes with every call) the names of its attributes."""
    return {key: ({k: id(v) for k, v in vars(obj).items()}, id(getattr(obj, "processor", None)))
            if isinstance(obj, torch.nn.Module) else sorted(vars(obj))
            for key, obj in _objects(pipe).items() if hasattr(obj, "__dict__")}


def _bcg_left(pipe):
    return [(key, k) for key, obj in _objects(pipe).items() for k in getattr(obj, "__dict__", {})
            if "bcg" in k or k == REGISTRY_ATTR]


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3"])
@pytest.mark.parametrize("policy", ["auto", "attention"])
def test_unaccelerate_gives_back_the_same_pipeline_bit_for_bit(name, policy):
    pipe = load_pipeline(name, dtype=torch.float32)
    before = _run(pipe)
    components = {c: getattr(pipe, c) for c in pipe.components}
    snapshot = _snapshot(pipe)
    accelerate(pipe, config=RunnerConfig(), policy=policy, components=_components(pipe, ALL),
               options=TransformerOptions(attention_backend="math", quantize="fp8"))  # every hook, also on CPU
    transformer = pipe.transformer.module
    names = HookRegistry.of(transformer).names()
    assert names == ["bcg_quantize", "bcg_attention", "bcg_breaks"], names
    assert HookRegistry.of(pipe).names() == ["bcg_pipeline", "bcg_tokenizers"]
    # on the CPU it runs eagerly; the "math" attention kernel rounds otherwise than SDPA's choice
    assert np.abs(_run(pipe) - before).max() < 1e-4
    unaccelerate(pipe)
    assert {c: getattr(pipe, c) for c in pipe.components} == components  # the same objects in every slot
    assert _bcg_left(pipe) == []
    assert all(list(bcg_hooks_on(c)) == [] for c in components.values() if c is not None)
    after = _snapshot(pipe)
    changed = {k: (snapshot[k], after.get(k)) for k in snapshot if snapshot[k] != after.get(k)}
    assert changed == {}, sorted(changed)[:5]
    assert np.array_equal(_run(pipe), before)


def test_unaccelerate_leaves_what_others_installed():
    from bcg.lora import LoraBank, lora_bank, target_names

    pipe = load_pipeline("tiny-flux")
    bank = LoraBank.install(pipe.transformer, target_names(pipe.transformer, ["to_q"]))
    accelerate(pipe)
    unaccelerate(pipe)
    assert lora_bank(pipe.transformer) is bank and HookRegistry.of(pipe.transformer).names() == ["bcg_lora"]
    HookRegistry.of(pipe.transformer).remove_hook("bcg_lora")  # and the bank is undone by its own hook
    assert not any(type(m).__name__ == "LoraLinear" for m in pipe.transformer.modules())
    assert HookRegistry.of(pipe.transformer) is None


@pytest.mark.parametrize("enabled", ["before", "after"])
def test_step_caching_in_diffusers_registry_survives_unaccelerate(enabled):
    """Step caching is a hook in diffusers' own registry: enabled before or after accelerate, it keeps
    caching through unaccelerate, and the hooks accelerate registered leave with unaccelerate."""
    from bcg.diffusers.step_caching.hook import StepCacheConfig, disable_step_cache, enable_step_cache, step_cache_of

    def cached_counts(pipe):
        _, kwargs = plan_request(pipe, "a red circle", size="64x64", steps=4, seed=11, output_type="np")
        with step_cache_of(pipe).plain_request(StepCacheConfig(method="schedule", schedule=[0, 2], warmup_steps=0)) \
                as counts:
            image = np.asarray(pipe(**kwargs).images)
        return image, dict(counts)

    pipe = load_pipeline("tiny-flux")
    if enabled == "before":
        enable_step_cache(pipe, None)
    accelerate(pipe)
    if enabled == "after":
        enable_step_cache(pipe, None)
    image, counts = cached_counts(pipe)
    assert counts == {"computed": 2, "cached": 2}
    unaccelerate(pipe)
    # what stays is step caching's: its face in bcg's registry (the rows it reads) and its hooks on the first
    # and the middle blocks, which leave with it
    hooked = [(name, names) for name, _, names in bcg_hooks_on(pipe.transformer)]
    assert hooked == [("", ["bcg_step_cache"]), ("transformer_blocks.0", ["bcg_step_cache"]),
                      ("transformer_blocks.1", ["bcg_step_cache"])] + [
        (f"single_transformer_blocks.{i}", ["bcg_step_cache"]) for i in range(4)]
    again, counts = cached_counts(pipe)
    assert counts == {"computed": 2, "cached": 2} and np.array_equal(again, image)
    disable_step_cache(pipe)
    assert list(bcg_hooks_on(pipe.transformer)) == []
    assert np.array_equal(_run(pipe), _run(load_pipeline("tiny-flux")))  # the plain transformer again
