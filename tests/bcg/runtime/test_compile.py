"""bcg.runtime.compile on CPU: compiled forward with eager breaks, compile statistics, compile-friendly breaks.

Backends "eager" / "aot_eager" need no C++ toolchain; inductor and the capture itself are GPU tests
(test_compile_gpu.py).
"""
import pytest
import torch
from torch import nn

from bcg.graphs.capture import eager_on_graph
from bcg.diffusers.graph_breaks.compiled import install_compiled_breaks
from bcg.runtime.compile import CompiledForward, compile_for_segments

SEQ_LENS = (6, 10, 14, 22)  # four signatures; none equals a feature size (duck sizing would tie them)


@eager_on_graph
def _mix_over_sequence(h):
    # a stand-in for attention: eager between the compiled regions
    return h.softmax(dim=1) * h.shape[1]


class _TwoRegions(nn.Module):
    """Linear -> eager break -> linear: two compiled regions (the forward and its resume function)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h = self.inp(x).relu()
        h = _mix_over_sequence(h)
        return self.out(h) + x


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _unique_graphs():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_forward_with_break_matches_uncompiled_module(backend):
    module = _TwoRegions().eval()
    compiled = compile_for_segments(module, backend=backend)
    for n in SEQ_LENS[:2]:
        x = torch.randn(1, n, 8)
        with torch.no_grad():
            expected = module(x)
        torch.testing.assert_close(compiled(x=x), expected, rtol=0, atol=0)
    stats = compiled.stats()
    assert stats["graph_breaks"] >= 1  # the eager break really split the forward
    assert stats["frames_compiled"] == 2


def test_stats_count_frames_and_recompiles_across_four_shapes_with_marked_dims():
    module = _TwoRegions().eval()
    compiled = compile_for_segments(module, backend="eager", mark_dynamic={"x": 1})
    before = _unique_graphs()
    for n in SEQ_LENS:
        compiled(x=torch.randn(1, n, 8))
    stats = compiled.stats()

    assert stats["graphs_compiled"] == _unique_graphs() - before  # our count agrees with dynamo's
    assert stats["frames_compiled"] == 2
    per_signature = [(s["graphs"], s["new_frames"], s["recompiles"]) for s in stats["signatures"]]
    # The marked input reaches the forward (dynamic from the start); the break's output is a fresh tensor,
    # so the resume function is compiled static first and once more, dynamic, for the second shape.
    assert per_signature == [(2, 2, 0), (1, 0, 1), (0, 0, 0), (0, 0, 0)]
    assert stats["recompiles"] == stats["recompiles_after_first_signature"] == 1
    reason = stats["signatures"][1]["recompile_reasons"][0]
    assert "size mismatch" in reason and "resume" in reason
    assert all(s["calls"] == 1 and s["first_call_ms"] > 0 for s in stats["signatures"])
    # a first call that compiled (signatures 0 and 1) takes longer than one served by the code compiled
    # already (2 and 3); the total adds up every signature's first call
    first = [s["first_call_ms"] for s in stats["signatures"]]
    assert min(first[:2]) > max(first[2:])
    assert stats["compile_ms_total"] == pytest.approx(sum(first), abs=0.01)


def test_dynamic_true_compiles_once_for_four_shapes():
    module = _TwoRegions().eval()
    compiled = compile_for_segments(module, backend="eager", dynamic=True)
    for n in SEQ_LENS:
        x = torch.randn(1, n, 8)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x=x), module(x), rtol=0, atol=0)
    stats = compiled.stats()
    assert (stats["graphs_compiled"], stats["recompiles"]) == (2, 0)
    assert [s["graphs"] for s in stats["signatures"]] == [2, 0, 0, 0]


def test_static_compiles_per_shape_and_run_cached_never_compiles():
    module = _TwoRegions().eval()
    compiled = compile_for_segments(module, backend="eager", dynamic=False)
    compiled(x=torch.randn(1, SEQ_LENS[0], 8))
    graphs = compiled.stats()["graphs_compiled"]

    x = torch.randn(1, SEQ_LENS[1], 8)
    with torch.no_grad():
        expected = module(x)
    torch.testing.assert_close(compiled.run_cached(x=x), expected, rtol=0, atol=0)
    stats = compiled.stats()
    assert stats["graphs_compiled"] == graphs and stats["cached_calls"] == 1

    compiled(x=x)  # the ordinary call compiles static code for the new shape
    stats = compiled.stats()
    assert stats["graphs_compiled"] == graphs + 2 and stats["recompiles"] == 2
    assert stats["signatures"][1]["recompiles"] == 2


def test_compiled_forward_proxies_module_attributes():
    module = _TwoRegions()
    compiled = compile_for_segments(module, backend="eager")
    assert isinstance(compiled, CompiledForward)
    assert compiled.inp is module.inp and compiled.module is module


@pytest.mark.parametrize("kwargs, words", [
    (dict(mode="reduce-overhead"), "own CUDA graphs"),
    (dict(options={"triton.cudagraphs": True}), "leave it False"),
    (dict(backend="eager", options={"max_autotune": True}), "inductor backend only"),
    (dict(breaks="everything"), "'installed', a callable"),
    (dict(mark_dynamic={"x": "seq"}), "dim or a list of dims"),
])
def test_bad_settings_raise_and_name_the_fix(kwargs, words):
    with pytest.raises(ValueError, match=words):
        compile_for_segments(_TwoRegions(), **kwargs)


# -- a real diffusers model --------------------------------------------------------------------------


def _tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()


def _flux_inputs(n, txt=7):
    g = torch.Generator().manual_seed(n)
    return dict(hidden_states=torch.randn(1, n, 16, generator=g), encoder_hidden_states=torch.randn(1, txt, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(n, 3), txt_ids=torch.zeros(txt, 3))


def test_flux_compiled_with_attention_breaks_matches_eager_and_breaks_every_attention():
    from bcg.diffusers import install_breaks, remove_breaks

    module = _tiny_flux()
    inputs = _flux_inputs(36)
    with torch.no_grad():
        expected = module(**inputs).sample
    assert install_breaks(module, "attention") == 2  # capture-only breaks at every attention core
    compiled = compile_for_segments(module, backend="eager")  # ... made visible to dynamo
    from bcg.diffusers.graph_breaks.wrapping import breaks_hook
    attention = [m for m in module.modules() if hasattr(m, "set_processor")]
    originals = [breaks_hook(module).original_processor(m) for m in attention]
    assert all(breaks_hook(module).processor_kind(m).startswith("compiled") for m in attention)

    torch.testing.assert_close(compiled(**inputs).sample, expected, rtol=0, atol=0)
    stats = compiled.stats()
    sdpa_breaks = [e for e in stats["events"] if e["frame"].startswith("dispatch_attention_fn") and e["graph_break"]]
    assert len(sdpa_breaks) >= 1                 # the break sits at SDPA, permutes stay compiled
    assert stats["graph_breaks"] >= 4            # block -> attention, attention core, per block type
    assert stats["recompiles_after_first_signature"] == 0

    assert remove_breaks(module) == 2            # bcg.diffusers can still restore the originals
    assert breaks_hook(module) is None and [m.processor for m in attention] == originals


def test_install_compiled_breaks_is_idempotent_and_keeps_processor_state():
    module = _tiny_flux()
    first = install_compiled_breaks(module)
    processor = module.transformer_blocks[0].attn.processor
    assert install_compiled_breaks(module) == first == 2
    assert module.transformer_blocks[0].attn.processor is processor
    from bcg.diffusers.graph_breaks.wrapping import breaks_hook
    original = breaks_hook(module).original_processor(module.transformer_blocks[0].attn)
    assert processor.__dict__ is original.__dict__ and isinstance(processor, type(original))


def test_dynamo_seconds_grow_with_a_compile_and_the_backend_is_part_of_them():
    from bcg.runtime.compile import dynamo_seconds

    before = dynamo_seconds()
    torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="aot_eager")(torch.ones(3))
    after = dynamo_seconds()
    frames, backend = (after[k] - before[k] for k in ("frames_s", "backend_s"))
    assert frames > 0 and 0 < backend < frames
