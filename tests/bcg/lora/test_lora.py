"""LoRA adapters on the built-in tiny Flux pipeline, CPU float32: two adapters made with peft (non-zero
weights on the attention and MLP projections, one with alpha != rank) and saved with the pipeline's
``save_lora_weights``, served through `StepBatcher` and compared with diffusers' own pipeline that loaded
the same adapter (``load_lora_weights``), same seed."""
import numpy as np
import pytest
import torch

pytest.importorskip("peft")

from bcg.diffusers.step_batching.batcher import StepBatcher  # noqa: E402
from bcg.diffusers.models import load_pipeline  # noqa: E402
from bcg.diffusers.pipelines import plan_request  # noqa: E402
from bcg.lora import (AdapterConflictError, AdapterFileError, AdapterUnreadableError, UnknownAdapterError,  # noqa: E402
                      install_lora, lora_bank, read_adapter, target_names)
from bcg.lora.synthetic import make_adapter  # noqa: E402

# The issue's bound: an adapter request within 3/255 per pixel of diffusers' pipeline with the adapter
# loaded. (Seen here: 0 alone; peft computes B(A(x)) * scale, the slots hold B * scale.)
PIXEL_TOLERANCE = 3 / 255
# Rows of a step batch against the same request alone: the rounding of batched float32 kernels (as
# tests/bcg/diffusers/test_batching.py's bound); a row that used another row's adapter is off by > 1e-2.
BATCH_TOLERANCE = 3e-5
REQUEST = {"size": "64x64", "steps": 2, "guidance": 3.0, "output_type": "np"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapter directories: ``a`` (rank 4, alpha 8) and ``b`` (rank 2, alpha = rank, other layers)."""
    root = tmp_path_factory.mktemp("lora")
    a = _make(root / "a", rank=4, alpha=8, seed=1, std=0.3)
    b = _make(root / "b", rank=2, seed=2, std=0.5, targets=("to_q", "to_v", "ff.net.2", "proj_mlp"))
    return {"a": str(a), "b": str(b)}


def _make(directory, **kw):
    """An adapter for tiny-flux's transformer (peft, saved with FluxPipeline.save_lora_weights)."""
    pipe = load_pipeline("tiny-flux")
    return make_adapter(pipe.transformer, type(pipe), directory, **kw)


@pytest.fixture(scope="module")
def served(adapters):
    """A tiny-flux pipeline with LoRA slots holding both adapters, and its batcher (driven by the tests)."""
    pipe = load_pipeline("tiny-flux")
    install_lora(pipe, adapters, max_loras=3, max_rank=8)
    return pipe, StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))


def _plan(pipe, prompt, seed, **kw):
    return plan_request(pipe, prompt, seed=seed, **{**REQUEST, **kw})


def _serve(batcher, requests, **request):
    """Submit every ``(prompt, seed, lora)`` at once (they join one step), drive the batcher; the images.
    `request`: planning fields over `REQUEST`."""
    futures = []
    for prompt, seed, lora in requests:
        key, kwargs = _plan(batcher.pipe, prompt, seed, **request)
        futures.append(batcher.submit_planned(key, kwargs, lora=lora))
    for _ in range(100):
        if all(f.done() for f in futures):
            return [np.asarray(f.result()) for f in futures]
        batcher.step()
    raise AssertionError("requests not answered")


def _reference(adapter_path, prompt, seed, scale=None):
    """diffusers' own pipeline with the adapter loaded (None: no adapter)."""
    pipe = load_pipeline("tiny-flux")
    if adapter_path is not None:
        pipe.load_lora_weights(adapter_path, adapter_name="x")
        if scale is not None:
            pipe.set_adapters("x", adapter_weights=scale)
    _, kwargs = _plan(pipe, prompt, seed)
    return np.asarray(pipe(**kwargs).images)


@pytest.mark.parametrize("name", ["a", "b"])
def test_adapter_request_matches_diffusers_pipeline_with_the_adapter_loaded(served, adapters, name):
    pipe, batcher = served
    (image,) = _serve(batcher, [("a photo of a cat", 7, (name, 1.0))])
    expected, base = _reference(adapters[name], "a photo of a cat", 7), _reference(None, "a photo of a cat", 7)
    assert np.abs(image - expected).max() <= PIXEL_TOLERANCE
    assert np.abs(expected - base).max() > 10 * PIXEL_TOLERANCE  # the adapter changes the image


def test_lora_scale_matches_diffusers_adapter_weight(served, adapters):
    _, batcher = served
    (image,) = _serve(batcher, [("a dog", 3, ("a", 0.5))])
    assert np.abs(image - _reference(adapters["a"], "a dog", 3, scale=0.5)).max() <= PIXEL_TOLERANCE


def test_base_image_is_bitwise_unchanged_by_lora_layers_and_adapter_requests(served):
    _, batcher = served
    before = _serve(batcher, [("a red chair", 5, None)])[0]
    _serve(batcher, [("a red chair", 5, ("a", 1.0)), ("a red chair", 5, ("b", 1.0))])
    after = _serve(batcher, [("a red chair", 5, None)])[0]
    assert np.array_equal(before, after)
    assert np.array_equal(after, _reference(None, "a red chair", 5))  # as if no LoRA layer were there


def test_mixed_adapter_step_batch_equals_each_row_served_alone(served):
    _, batcher = served
    requests = [("a cat", 1, ("a", 1.0)), ("a dog", 2, ("b", 1.0)), ("a bird", 3, None), ("a fish", 4, ("a", 0.7))]
    mixed_before = batcher.stats()["mixed_adapter_steps"]
    together = _serve(batcher, requests)
    assert batcher.stats()["mixed_adapter_steps"] - mixed_before == REQUEST["steps"]  # all four in each step
    for request, image in zip(requests, together):
        alone = _serve(batcher, [request])[0]
        assert np.abs(image - alone).max() <= BATCH_TOLERANCE, request


def test_switching_adapters_keeps_the_buffers_the_graphs_read_and_the_signature(served, adapters):
    from bcg.runtime.runner import BreakableGraphRunner

    pipe, batcher = served
    bank = lora_bank(pipe.transformer)
    runner = BreakableGraphRunner(pipe.transformer)  # (on the CPU it captures nothing: its keys only)
    pointers = {name: (layer.lora_A.data_ptr(), layer.lora_B.data_ptr()) for name, layer in bank.layers.items()}
    rows = (bank.rows.slots.data_ptr(), bank.rows.scales.data_ptr())
    seen = {}
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.setdefault(served_as, []).append(runner.signature_of(*a, **kw)), with_kwargs=True)
    cases = {"a": [("a cat", 1, ("a", 1.0))], "b": [("a cat", 1, ("b", 1.0))], "base": [("a cat", 1, None)],
             "mixed": [("a cat", 1, ("a", 1.0)), ("a dog", 2, None)]}
    try:
        for served_as, requests in cases.items():
            _serve(batcher, requests)
    finally:
        hook.remove()
    assert all(len(calls) == REQUEST["steps"] for calls in seen.values())
    keys = {served_as: {s.key for s in calls} for served_as, calls in seen.items()}
    # one graph serves every adapter, and a step mixing an adapter row with a base row; base steps another
    assert keys["a"] == keys["b"] and len(keys["a"]) == 1
    assert keys["base"].isdisjoint(keys["a"]) and len(keys["base"]) == 1
    assert seen["base"][0].diff(seen["a"][0]) == ["lora off != unset"]
    assert seen["mixed"][0].context == {} and seen["base"][0].context == {"lora": "off"}
    assert {n: (l.lora_A.data_ptr(), l.lora_B.data_ptr()) for n, l in bank.layers.items()} == pointers
    assert (bank.rows.slots.data_ptr(), bank.rows.scales.data_ptr()) == rows


def test_base_rows_skip_the_update_and_give_the_layer_alone():
    from bcg.lora import AdapterWeights, LoraBank

    layer = torch.nn.Linear(8, 6)
    bank = LoraBank.install(torch.nn.Sequential(layer), ["0"], max_loras=1, max_rank=2, max_rows=4)
    bank.load("x", AdapterWeights({"0": (torch.randn(2, 8), torch.randn(6, 2))}))
    lora, x = bank.layers["0"], torch.randn(3, 5, 8)
    bank.set_rows([None, None, None])
    assert not bank.rows.enabled and bank.signature_context() == (("lora", "off"),)
    assert torch.equal(lora(x), layer(x))
    bank.set_rows([None, ("x", 1.0), None])
    assert bank.rows.enabled and bank.signature_context() == ()
    with_row = lora(x)
    assert torch.equal(with_row[0], layer(x)[0]) and not torch.equal(with_row[1], layer(x)[1])
    bank.set_all(None, enabled=True)  # a warmup's: base rows through the layers that compute (adding zeros)
    assert bank.rows.enabled and torch.equal(lora(x), layer(x))


def test_a_compiled_lora_layer_serves_every_row_choice_from_one_graph():
    # dynamo with the eager backend: a switch, or rows of several adapters, must hit the graph compiled
    # for the first call (no guard on the buffers' values); inductor's code is fed by these graphs
    import torch._dynamo
    from torch._dynamo.utils import counters

    from bcg.lora import AdapterWeights, LoraBank

    layer = torch.nn.Linear(8, 6)
    bank = LoraBank.install(torch.nn.Sequential(layer), ["0"], max_loras=2, max_rank=2, max_rows=4)
    module = torch.nn.Sequential(bank.layers["0"])
    bank.load("x", AdapterWeights({"0": (torch.randn(2, 8), torch.randn(6, 2))}))
    bank.load("y", AdapterWeights({"0": (torch.randn(1, 8), torch.randn(6, 1))}))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend="eager")
    x = torch.randn(3, 5, 8)
    outs = {}
    # base rows computing the update (a warmup's), adapters, and a mix: one graph
    for choice in [None, ("x", 1.0), ("y", 0.5), [("x", 1.0), ("y", 1.0), None]]:
        bank.set_rows(choice if isinstance(choice, list) else [choice] * 3, enabled=True)
        outs[str(choice)] = compiled(x)
        assert torch.allclose(outs[str(choice)], module(x))
    assert counters["stats"]["unique_graphs"] == 1
    assert not torch.equal(outs["None"], outs[str(("x", 1.0))])
    # base rows alone: the graph without the update, compiled once, the linear layer's own output
    for choice in [None, ("x", 1.0), None]:
        bank.set_rows([choice] * 3)
        assert torch.equal(compiled(x), module(x))
    assert torch.equal(compiled(x), layer(x))
    assert counters["stats"]["unique_graphs"] == 2


def test_bad_adapter_file_names_what_is_wrong_and_loses_nothing(served, adapters, tmp_path):
    pipe, batcher = served
    bank = lora_bank(pipe.transformer)
    before = _serve(batcher, [("a cat", 1, ("a", 1.0))])[0]
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    # nothing readable at the path: its own kind (a server answers these alike, deployments.lora)
    with pytest.raises(AdapterUnreadableError, match="junk.safetensors"):
        read_adapter(pipe, str(tmp_path / "junk.safetensors"))
    with pytest.raises(AdapterUnreadableError, match="no such file"):
        read_adapter(pipe, str(tmp_path / "missing"))
    wide = _make(tmp_path / "wide", rank=16, seed=3)
    with pytest.raises(AdapterFileError, match="max_lora_rank=8") as too_wide:
        bank.load("wide", read_adapter(pipe, str(wide)))
    assert not isinstance(too_wide.value, AdapterUnreadableError)   # an adapter, not fitting
    other = _make(tmp_path / "other", rank=2, seed=4, targets=("norm.linear",))
    with pytest.raises(AdapterFileError, match="lora_target_modules"):
        bank.load("other", read_adapter(pipe, str(other)))
    with pytest.raises(AdapterConflictError, match="loaded already"):
        bank.load("a", read_adapter(pipe, adapters["b"]))
    assert bank.adapters() == ["a", "b"]
    assert np.array_equal(_serve(batcher, [("a cat", 1, ("a", 1.0))])[0], before)


def test_unknown_adapter_fails_its_request_alone_and_unload_frees_the_slot(served, adapters):
    pipe, batcher = served
    bank = lora_bank(pipe.transformer)
    key, kwargs = _plan(pipe, "a cat", 1)
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        batcher.submit_planned(key, kwargs, lora=("nope", 1.0))
    bank.load("c", read_adapter(pipe, adapters["b"]))
    with pytest.raises(AdapterConflictError, match="max_loras=3"):
        bank.load("d", read_adapter(pipe, adapters["b"]))
    # unloaded while its request runs: that request fails at its next step, its neighbour goes on
    futures = []
    for lora in (("c", 1.0), ("a", 1.0)):
        key, kwargs = _plan(pipe, "a cat", 1)
        futures.append(batcher.submit_planned(key, kwargs, lora=lora))
    batcher.step()
    bank.unload("c")
    while not all(f.done() for f in futures):
        batcher.step()
    with pytest.raises(UnknownAdapterError, match="'c'"):
        futures[0].result()
    assert futures[1].exception() is None
    assert bank.adapters() == ["a", "b"]
    assert all(not layer.lora_A[3].any() for layer in bank.layers.values())  # its slot is zeros again
    with pytest.raises(UnknownAdapterError):
        bank.unload("c")


def test_compiled_segments_serve_every_adapter_without_recompiling():
    # the runner's compile path (compile_for_segments, attention breaks) on a Flux transformer with LoRA
    # layers: switching adapters hits the frames the first call compiled, and matches the module eagerly
    from bcg.diffusers import install_breaks
    from bcg.lora import AdapterWeights, LoraBank
    from bcg.runtime.compile import compile_for_segments
    from tests.bcg.runtime.test_compile import _flux_inputs, _tiny_flux

    torch._dynamo.reset()
    module = _tiny_flux()
    names = target_names(module, ("to_q", "to_v", "ff.net.2", "proj_mlp"))
    bank = LoraBank.install(module, names, max_loras=2, max_rank=2, max_rows=4)
    g = torch.Generator().manual_seed(0)
    for name in ("x", "y"):
        bank.load(name, AdapterWeights({m: (torch.randn(2, layer.in_features, generator=g) * 0.3,
                                            torch.randn(layer.out_features, 2, generator=g) * 0.3)
                                        for m, layer in bank.layers.items()}))
    inputs = _flux_inputs(36)
    # the first two calls compile the two states (an adapter row; base rows alone), the rest switch
    choices = [("x", 1.0), None, ("y", 0.5), None, ("x", 1.0)]
    with torch.no_grad():
        expected = []
        for choice in choices:
            bank.set_rows([choice])
            expected.append(module(**inputs).sample)
        install_breaks(module, "attention")
        compiled = compile_for_segments(module, backend="eager")
        warm = None
        for i, (choice, want) in enumerate(zip(choices, expected)):
            bank.set_rows([choice])
            torch.testing.assert_close(compiled(**inputs).sample, want, rtol=0, atol=0)
            warm = compiled.stats() if i == 1 else warm
    stats = compiled.stats()
    # (the first call compiles Flux's frames, recompiling two of them for its block shapes; the second
    # recompiles the frames whose LoRA layers skip the update)
    assert (stats["graphs_compiled"], stats["recompiles"]) == (warm["graphs_compiled"], warm["recompiles"])
    assert stats["calls"] == len(choices) and stats["graphs_compiled"] > 0
    assert not torch.equal(expected[0], expected[1])
    torch._dynamo.reset()


def test_sd3_cfg_rows_follow_their_request_and_match_diffusers(tmp_path):
    # SD3 runs CFG as one call of [negatives; positives]: each half's rows take their request's adapter
    sd3 = load_pipeline("tiny-sd3")
    path = str(make_adapter(sd3.transformer, type(sd3), tmp_path / "s", rank=2, seed=5, std=0.3,
                            targets=("to_q", "to_v", "ff.net.2")))
    install_lora(sd3, {"s": path}, max_loras=1, max_rank=2)
    batcher = StepBatcher(sd3, max_batch_size=4, batch_buckets=(1, 2, 4))
    requests = [("a cat", 1, ("s", 1.0)), ("a dog", 2, None), ("a bird", 3, ("s", 1.0))]
    together = _serve(batcher, requests, guidance=5.0)
    assert batcher.stats()["mixed_adapter_steps"] == REQUEST["steps"]
    for request, image in zip(requests, together):
        assert np.abs(image - _serve(batcher, [request], guidance=5.0)[0]).max() <= BATCH_TOLERANCE, request
    reference = load_pipeline("tiny-sd3")
    reference.load_lora_weights(path)
    _, kwargs = _plan(reference, "a cat", 1, guidance=5.0)
    expected = np.asarray(reference(**kwargs).images)
    assert np.abs(together[0] - expected).max() <= PIXEL_TOLERANCE
    plain = load_pipeline("tiny-sd3")
    _, kwargs = _plan(plain, "a cat", 1, guidance=5.0)
    assert np.abs(expected - np.asarray(plain(**kwargs).images)).max() > 10 * PIXEL_TOLERANCE  # it changes it


def test_row_scales_are_kept_in_the_layers_dtype_and_give_the_float32_scales_result():
    from bcg.lora import LoraBank
    from bcg.lora.bank import AdapterWeights
    from bcg.lora.layers import LoraRows

    def model(dtype):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(dtype)

    bf16 = model(torch.bfloat16)
    bank = LoraBank.install(bf16, ["0", "1"], max_loras=1, max_rank=2)
    assert bank.rows.scales.dtype == torch.bfloat16  # no cast per layer
    g = torch.Generator().manual_seed(1)
    weights = AdapterWeights({"0": (torch.randn(2, 16, generator=g), torch.randn(32, 2, generator=g)),
                              "1": (torch.randn(2, 32, generator=g), torch.randn(8, 2, generator=g))})
    bank.load("x", weights)
    bank.set_rows([("x", 0.3), None])
    x = torch.randn(2, 5, 16, generator=g).to(torch.bfloat16)
    out = bf16(x)
    bank.set_rows([None, None])
    base = bf16(x)
    assert not torch.equal(base[0], out[0]) and torch.equal(base[1], out[1])  # row 0 has the adapter
    float32_rows = LoraRows(bank.rows.max_rows)  # float32 scales, each layer casting them
    float32_rows.write([1, 0], [0.3, 0.0])
    for layer in bank.layers.values():
        layer.rows = float32_rows
    assert torch.equal(bf16(x), out)
    mixed = model(torch.float32)
    mixed[1].to(torch.bfloat16)
    assert LoraBank.install(mixed, ["0", "1"]).rows.scales.dtype == torch.float32  # two dtypes: each layer casts


def test_warmup_runs_both_lora_states_and_leaves_the_base_rows(served):
    # the graphs a step with an adapter row replays and those of base rows alone: a warmup captures both
    pipe, batcher = served
    bank = lora_bank(pipe.transformer)
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a: seen.append(bank.rows.enabled))
    try:
        key, _ = _plan(pipe, "a cat", 1)
        report = batcher.warmup([key])
    finally:
        hook.remove()
    assert report["failed"] == 0
    steps = 2  # StepBatcher.warmup's default: each key of the plan (its buckets) with, then without, the update
    assert seen == ([True] * steps + [False] * steps) * len(report["keys"]) and len(report["keys"]) > 1
    assert not bank.rows.enabled and bank.signature_context() == (("lora", "off"),)



def test_rows_that_compute_under_step_caching_keep_their_adapters(adapters):
    """Step caching runs the middle blocks on the rows that compute only, gathered: the LoRA layers there
    read the gathered rows (the rows context step caching narrows, `bcg.runtime.rows`), so each row keeps
    its own adapter. A request that caches its steps beside two that compute gives its image alone."""
    from bcg.diffusers.step_caching.hook import StepCacheConfig, enable_step_cache

    pipe = load_pipeline("tiny-flux")
    install_lora(pipe, adapters, max_loras=3, max_rank=8)
    enable_step_cache(pipe, None)
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))
    bank = lora_bank(pipe.transformer)
    caches = StepCacheConfig(method="schedule", schedule=[0], warmup_steps=0)  # steps 1, 2 cached
    # the first request caches: from step 1 the rows that compute are rows 1 and 2, gathered to rows 0 and 1
    requests = [("a cat", 1, ("a", 1.0), caches), ("a dog", 2, ("b", 1.0), None), ("a bird", 3, None, None)]

    def serve(batch):
        futures = []
        for prompt, seed, lora, cache in batch:
            key, kwargs = _plan(pipe, prompt, seed, steps=3)
            futures.append(batcher.submit_planned(key, kwargs, lora=lora, cache=cache))
        while not all(f.done() for f in futures):
            batcher.step()
        return [np.asarray(f.result()) for f in futures]

    together = serve(requests)
    assert batcher.stats()["steps_cached"] == 2 and 2 in batcher.stats()["step_cache"]["middle_buckets"]
    assert bank.rows.slots[:3].tolist() == [1, 2, 0]   # the call's rows set back after the gathered call
    for request, image in zip(requests, together):
        (alone,) = serve([request])
        assert np.abs(image - alone).max() <= BATCH_TOLERANCE, request[:3]
