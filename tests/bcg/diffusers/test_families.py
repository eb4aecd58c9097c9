"""Model-family records: every record is complete (its built-in pipeline, CFG rule, step hooks and step-caching
adapter resolve), and each CFG rule inverts for warmup."""
import pytest

from bcg.diffusers import pipeline_info, plan_request
from bcg.diffusers.families import FAMILIES, GENERIC, BatchingHooks, CfgRule, family_named, family_of
from bcg.diffusers.models import BUILTIN_MODELS, load_pipeline

NAMED = [f for f in FAMILIES.values() if f is not GENERIC]


def test_every_family_names_a_builtin_pipeline_of_its_own_class():
    # each family's random tiny pipeline; the trained built-ins (shapes-flux) and the other forms of a family's
    # pipeline class (Wan2.2's image-to-video) belong to a named family too
    others = {"shapes-flux": "flux", "tiny-wan22-i2v": "wan-i2v", "tiny-wan22-ti2v": "wan-i2v"}
    assert sorted(f.builtin for f in NAMED) == sorted(set(BUILTIN_MODELS) - set(others))
    for name, family in others.items():
        assert family_of(load_pipeline(name)) is family_named(family)
    for family in NAMED:
        pipe = load_pipeline(family.builtin)
        assert family_of(pipe) is family and type(pipe).__name__ in family.pipeline_classes
        assert pipeline_info(pipe)["family"] == family.name
        assert hasattr(pipe, family.prompt_tokenizer)


def test_unknown_pipelines_are_generic_and_unknown_names_are_errors():
    class MyPipeline:
        pass

    assert family_of(MyPipeline()) is GENERIC and family_of(MyPipeline) is GENERIC


def test_a_record_asking_for_config_values_is_picked_where_the_pipeline_config_holds_them():
    # WanPipeline: Wan2.1's (wan) and Wan2.2 TI2V-5B's (expand_timesteps: wan-ti2v, which makes image-to-video)
    from diffusers import WanPipeline

    wan, ti2v = family_named("wan"), family_named("wan-ti2v")
    assert ti2v.pipeline_classes == wan.pipeline_classes and dict(ti2v.pipeline_config) == {"expand_timesteps": True}
    assert family_of(load_pipeline("tiny-wan")) is wan and family_of(WanPipeline) is wan   # a class: its plain record
    assert family_of(load_pipeline("tiny-wan22-ti2v-5b")) is ti2v
    assert dict(ti2v.edit_pipelines) == {"image-to-video": "WanImageToVideoPipeline"} and not ti2v.needs_image
    assert family_named("generic") is GENERIC
    with pytest.raises(ValueError, match="known: flux"):
        family_named("flux2")


@pytest.mark.parametrize("family", NAMED, ids=lambda f: f.name)
@pytest.mark.parametrize("default_scale", [None, 1.0, 3.5, 7.0])
@pytest.mark.parametrize("cfg", [False, True])
def test_the_request_a_cfg_rule_makes_for_a_key_runs_cfg_as_the_key_says(family, default_scale, cfg):
    guidance, negative = family.cfg.request_for(cfg, default_scale)
    ran, kwargs = family.cfg.call_kwargs(guidance, negative, default_scale)
    assert ran is cfg and family.cfg.runs_cfg(guidance, negative, default_scale) is cfg
    assert ("negative_prompt" in kwargs) is (cfg and (negative is not None or family.cfg.default_negative_prompt
                                                     is not None))
    if cfg:
        assert kwargs[family.cfg.scale_arg] > 1


def test_a_request_carrying_its_key_runs_at_it_and_debug_runs_assert_what_contradicts_it():
    pipe = load_pipeline("tiny-sd3")
    key, kwargs = plan_request(pipe, "a cat", key="128x64.b2.cfg.p64", size="128x64", n=2, steps=1)
    assert key.key == "128x64.b2.cfg.p64"
    assert (kwargs["width"], kwargs["height"], kwargs["num_images_per_prompt"]) == (128, 64, 2)
    assert kwargs["max_sequence_length"] == 64 and kwargs["guidance_scale"] > 1
    # the key is trusted (checked where it was built); with asserts on, what contradicts it is named
    with pytest.raises(AssertionError, match=r"n=1 disagree"):
        plan_request(pipe, "a cat", key="128x64.b2.cfg", n=1)
    with pytest.raises(AssertionError, match=r"size='64x64' disagree"):
        plan_request(pipe, "a cat", key="128x64.cfg", size="64x64")
    with pytest.raises(AssertionError, match="runs no CFG"):
        plan_request(pipe, "a cat", key="128x64")            # the default scale 7 runs CFG
    with pytest.raises(AssertionError, match="multiples of 16"):
        plan_request(pipe, "a cat", key="100x64.cfg")
    with pytest.raises(ValueError, match="multiples of 16"):  # a key computed here is checked here
        plan_request(pipe, "a cat", size="100x64")


def test_batching_hooks_are_found_through_the_family_record():
    from bcg.diffusers.step_batching.batcher import StepBatcher
    batched = {f.name for f in FAMILIES.values() if f.batching is not None}
    assert batched == {"flux", "flux-kontext", "sd3", "qwen-image-edit", "qwen-image-edit-plus"}
    for family in NAMED:
        pipe = load_pipeline(family.builtin)
        hooks = family_of(pipe).batching_hooks()
        assert type(hooks) is type(family.batching_hooks())
        assert hooks is None or isinstance(hooks, BatchingHooks)
        assert type(StepBatcher(pipe).family) is type(hooks)


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-flux-kontext", "tiny-sd3"])
def test_the_step_hooks_run_cfg_exactly_when_the_request_key_does(name):
    # one CFG rule (`CfgRule.runs`): the key a request is planned at and the step hooks that batch it agree
    from bcg.diffusers.call_args import call_defaults

    pipe = load_pipeline(name)
    hooks = family_of(pipe).batching_hooks()
    seen = set()
    for guidance in (None, 0.5, 1.0, 3.0):
        for negative in (None, "", "blurry"):
            key, kwargs = plan_request(pipe, "a cat", size="64x64", guidance=guidance, negative_prompt=negative)
            assert hooks._cfg(call_defaults(pipe) | kwargs) is key.cfg, (guidance, negative)
            seen.add(key.cfg)
    assert seen == {False, True}


@pytest.mark.parametrize("family", NAMED, ids=lambda f: f.name)
def test_every_record_is_complete_and_names_what_resolves_on_its_builtin(family):
    """A record names its pipeline classes, built-in, CFG rule, edit pipelines, step hooks and step-caching
    adapter; every name it gives resolves (on its built-in pipeline), and a family without step hooks or
    caching says so."""
    from bcg.diffusers.families import BlockAdapter, family_of_transformer
    from bcg.diffusers.step_caching.blocks import adapter_blocks
    from bcg.diffusers.step_caching.hook import supports_step_cache

    import diffusers

    from bcg.diffusers.image_inputs import EDIT_KINDS

    assert family.pipeline_classes and family.builtin in BUILTIN_MODELS and isinstance(family.cfg, CfgRule)
    for kind, cls in family.edit_pipelines.items():   # each edit names a diffusers pipeline class
        assert kind in EDIT_KINDS and isinstance(getattr(diffusers, cls), type), (kind, cls)
    pipe = load_pipeline(family.builtin)
    hooks = family.batching_hooks()
    assert (hooks is None) is (family.batching is None)
    if hooks is not None:   # the step hooks are the family's own, by name
        assert isinstance(hooks, BatchingHooks) and hooks.name == family.name
    adapter = family.step_cache
    assert supports_step_cache(pipe) is (adapter is not None)
    if adapter is None:
        assert family_of_transformer(pipe.transformer) is None
        return
    assert isinstance(adapter, BlockAdapter)
    # Flux-Kontext hooks Flux's transformer class with Flux's adapter (Wan I2V Wan's, Qwen-Image-Edit
    # Qwen-Image's): the transformer's family is the first
    assert family_of_transformer(pipe.transformer).step_cache is adapter
    blocks = adapter_blocks(pipe.transformer, adapter, family.name)   # its lists, taking its per-row arguments
    assert len(blocks) >= 2 and all(b in list(pipe.transformer.modules()) for b in blocks)   # first + middle


def test_the_families_step_caching_runs_are_the_ones_whose_records_name_an_adapter():
    assert {f.name for f in NAMED if f.step_cache} == {"flux", "flux-kontext", "sd3", "wan", "wan-ti2v", "wan-i2v",
                                                       "qwen-image", "qwen-image-edit", "qwen-image-edit-plus"}
    adapters = {}
    for family in NAMED:
        for cls in family.step_cache.transformer_classes if family.step_cache else ():
            assert adapters.setdefault(cls, family.step_cache) is family.step_cache, cls   # one adapter per class


@pytest.mark.parametrize("bad, match", [
    (dict(transformer_classes=(), block_lists=("blocks",)), "names its transformer classes"),
    (dict(transformer_classes=("T",), block_lists=("blocks",), returns=("encoder_hidden_states",)), "returns"),
    (dict(transformer_classes=("T",), block_lists=("blocks",), row_args=("hidden_states",)), "row_args"),
])
def test_a_block_adapter_that_cannot_work_is_refused_naming_the_field(bad, match):
    from bcg.diffusers.families import BlockAdapter

    with pytest.raises(ValueError, match=match):
        BlockAdapter(**bad)
