"""bcg.graphs.capture on a GPU: replay correctness (hand-checkable and a real Flux transformer, bit for bit),
pool memory, side streams, capture stubs, clear errors, and clean state after failed captures."""
import gc
import sys
import warnings
import weakref

import pytest
import torch

from bcg.graphs.capture import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakOutputMismatchError,
    _ACTIVE_CAPTURE,
    break_graph,
    capture_after_warmup,
    current_replay_token,
    eager_on_graph,
    pool_reserved_bytes,
    replay_token_scope,
)
from bcg.graphs.pool import ExpandableSegments
from bcg.graphs.streams import CaptureStream

pytestmark = pytest.mark.gpu
MB = 1 << 20


def _capture(fn, *args, pool=None, stream=None, warmup=1, token=None, expandable_segments=True):
    """What the runner does: warm up eagerly on the capture stream, then capture on it."""
    graph = BreakableCUDAGraph()
    with torch.no_grad(), replay_token_scope(token):
        out = capture_after_warmup(graph, fn, args, pool=pool, stream=stream, warmup_runs=warmup,
                                   expandable_segments=expandable_segments)
    return graph, out


def _assert_clean():
    assert _ACTIVE_CAPTURE.get() is None
    assert sys.getprofile() is None  # the capture's fork watch is gone
    assert not torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------------------------------------
# arithmetic


def test_replay_hand_checkable_arithmetic_across_three_segments():
    calls = {"first": 0, "second": 0}

    @eager_on_graph
    def first_break(y):
        calls["first"] += 1
        return y + 100

    @eager_on_graph
    def second_break(w, scale):
        calls["second"] += 1
        return w * scale + current_replay_token(), w - 1

    def forward(x):
        y = x * 2                     # segment 0
        z = first_break(y)            # break 0
        w = z + 1                     # segment 1
        a, b = second_break(w, 3)     # break 1
        return a + b                  # segment 2: 4w - 1 + t = 8x + 403 + t

    static_x = torch.zeros(1024, device="cuda")
    graph, out = _capture(forward, static_x, token=0)
    assert (graph.num_segments, graph.num_breaks) == (3, 2)
    assert graph.break_names[0].endswith("first_break") and graph.break_names[1].endswith("second_break")
    assert calls == {"first": 2, "second": 2}  # warm-up + capture
    for step, token in enumerate((1, 2, 3), start=1):
        x = torch.arange(1024, device="cuda", dtype=torch.float32) * step
        static_x.copy_(x)
        with replay_token_scope(token):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, 8 * x + 403 + token)  # `out` refreshed in place
    assert calls == {"first": 5, "second": 5}
    _assert_clean()


def test_break_inputs_from_the_pool_are_not_kept_alive_and_pool_memory_is_reused():
    refs = []
    n = 4 * MB  # float32 elements: 16 MiB per tensor

    @eager_on_graph
    def stage(t):
        refs.append(weakref.ref(t))
        return t + 1

    def forward(x):
        for _ in range(8):
            x = stage(x * 2)          # x * 2 lives in the pool, dies after the break
        return x

    static_x = torch.ones(n, device="cuda")
    graph, out = _capture(forward, static_x)
    gc.collect()
    assert all(ref() is None for ref in refs[8:])  # capture-time inputs: only aliases were kept
    assert all(not bridges.owned for bridges in graph._bridges)
    # Eager holds at most ~3 of these tensors at once; holding every input and bridge would be 16.
    assert pool_reserved_bytes(graph.pool) <= 5 * 16 * MB
    static_x.fill_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.full((n,), 0.5, device="cuda")
    for _ in range(8):
        expected = expected * 2 + 1
    assert torch.equal(out, expected)


def test_two_captures_share_one_pool_and_replay_in_order():
    @eager_on_graph
    def brk(t):
        return t * 3

    def forward(x):
        return brk(x + 1) - 2

    x1 = torch.zeros(256, device="cuda")
    x2 = torch.zeros(64, 8, device="cuda")
    g1, out1 = _capture(forward, x1)
    g2, out2 = _capture(forward, x2, pool=g1.pool)
    assert g2.pool == g1.pool
    for k in range(3):
        x1.fill_(k)
        x2.fill_(10 + k)
        g1.replay()
        r1 = out1.clone()  # outputs of captures sharing a pool are only valid until the next replay
        g2.replay()
        r2 = out2.clone()
        torch.cuda.synchronize()
        assert torch.equal(r1, torch.full_like(r1, (k + 1) * 3 - 2))
        assert torch.equal(r2, torch.full_like(r2, (10 + k + 1) * 3 - 2))


def test_resetting_a_graph_keeps_the_cublas_workspace_of_graphs_captured_on_the_same_stream():
    # In torch after 2.11, CUDAGraph.reset() frees the cuBLAS workspace cached for its capture stream,
    # whose address every graph captured on that stream baked into its GEMMs (pytorch/pytorch#193402).
    # torch 2.11.0 keeps it (measured), so there this only checks that nothing else changed.
    @eager_on_graph
    def brk(t):
        return t + 1

    def forward(x, w):
        return brk(x @ w) @ w

    stream = CaptureStream()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(512, 512, device="cuda", generator=g) / 16
    x1, x2 = torch.randn(2, 256, 512, device="cuda", generator=g).unbind(0)
    first, _ = _capture(forward, x1, w, stream=stream)
    second, out = _capture(forward, x2, w, stream=stream)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    first.reset()
    assert torch.cuda.memory_allocated() == allocated          # the workspace was not freed
    assert stream.parked_segments == 2
    with torch.cuda.stream(stream.stream):                        # would land in a freed workspace
        hog = [torch.full((MB // 4,), 7.0, device="cuda") for _ in range(64)]
    torch.cuda.current_stream().wait_stream(stream.stream)
    for _ in range(3):
        x2.normal_(generator=g)
        second.replay()
        with torch.no_grad():
            expected = forward(x2, w)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    assert all(bool((h == 7.0).all()) for h in hog)
    second.reset()
    assert stream.parked_segments == 0


def test_empty_segments_are_counted_and_skipped_without_warnings():
    def forward(x):
        break_graph()                 # segment 0 has no kernels
        y = x + 1
        break_graph()
        break_graph()                 # segment 2 has no kernels
        return y * 3

    x = torch.zeros(16, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph, out = _capture(forward, x)
    assert not [w for w in caught if "empty" in str(w.message).lower()]
    assert (graph.num_segments, graph.num_breaks, graph.num_empty_segments) == (4, 3, 2)
    x.fill_(2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((16,), 9.0, device="cuda"))


# ------------------------------------------------------------------------------------------------
# side streams, stubs, errors


@pytest.mark.parametrize("join", [True, False], ids=["joined", "not-joined"])
def test_segment_that_forks_a_side_stream(join):
    side = torch.cuda.Stream()

    @eager_on_graph
    def brk(t):
        return t + 1

    def forward(x):
        y = x * 2
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            z = y + 3
        if join:
            torch.cuda.current_stream().wait_stream(side)
        w = brk(z)                    # not joined: the capture joins `side` before ending the segment
        return w * 2

    x = torch.zeros(4096, device="cuda")
    graph, out = _capture(forward, x)
    for k in (1, 5, 9):
        x.fill_(k)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, 4 * k + 8))
    _assert_clean()


def test_capture_stub_runs_at_capture_and_the_real_function_at_every_replay():
    calls = {"stub": 0, "real": 0}

    def stub(t):
        calls["stub"] += 1
        return torch.empty_like(t)

    @eager_on_graph(capture_stub=stub)
    def normalize(t):
        calls["real"] += 1
        return t / t.sum().item()     # a host sync: impossible inside a graph, fine in a break

    def forward(x):
        return normalize(x + 1) * 10

    x = torch.zeros(4, device="cuda")
    graph, out = _capture(forward, x)
    assert calls == {"stub": 1, "real": 1}  # warm-up ran the real one, capture the stub
    for k, values in enumerate(([1.0, 2, 3, 4], [0.0, 0, 0, 6], [3.0, 3, 3, 3]), start=1):
        x.copy_(torch.tensor(values))
        graph.replay()
        torch.cuda.synchronize()
        shifted = torch.tensor(values) + 1
        assert torch.allclose(out.cpu(), shifted / shifted.sum() * 10)
        assert calls == {"stub": 1, "real": 1 + k}


def test_break_output_shape_change_at_replay_raises_a_clear_error():
    @eager_on_graph
    def head(t):
        return t[: current_replay_token()] * 1

    def forward(x):
        return head(x * 2) + 1

    x = torch.arange(8.0, device="cuda")
    graph, out = _capture(forward, x, token=4)
    with replay_token_scope(4):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.tensor([1.0, 3, 5, 7], device="cuda"))
    with replay_token_scope(2), pytest.raises(BreakOutputMismatchError) as err:
        graph.replay()
    message = str(err.value)
    assert "head" in message and "output" in message and "(4,)" in message and "(2,)" in message

    @eager_on_graph
    def sometimes_pair(t):
        return (t, t) if current_replay_token() else t + 0

    graph2, _ = _capture(lambda t: sometimes_pair(t * 1) * 2, x, token=0)
    with replay_token_scope(1), pytest.raises(BreakOutputMismatchError, match="sometimes_pair"):
        graph2.replay()


def test_a_python_value_from_a_break_that_changes_at_replay_raises_before_the_next_segment():
    host = {"steps": 5}

    @eager_on_graph
    def plan(t):
        return t + 1, host["steps"]       # a host-side decision the rest of the forward uses

    def forward(x):
        y, steps = plan(x * 2)
        return y * steps                  # captured with steps == 5

    x = torch.arange(8.0, device="cuda")
    graph, out = _capture(forward, x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (x * 2 + 1) * 5)
    x.fill_(100.0)
    host["steps"] = 7
    with pytest.raises(BreakOutputMismatchError) as err:
        graph.replay()
    torch.cuda.synchronize()
    assert "plan" in str(err.value) and "int 7" in str(err.value) and "int 5" in str(err.value)
    # the segment after the break never ran with the stale 5 (it would have written 201 * 5); `out`
    # itself may hold a temporary of the first segment, whose pool memory it shares
    assert not torch.equal(out, torch.full_like(out, 201.0 * 5))
    host["steps"] = 5
    graph.replay()                        # the graph is intact: the same value replays again
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 201.0 * 5))


def test_nested_capture_raises_and_leaves_no_capture_open():
    graph = BreakableCUDAGraph()
    x = torch.ones(8, device="cuda")
    with pytest.raises(RuntimeError, match="nested"):
        with BreakableCUDAGraphCapture(graph):
            y = x * 2
            with BreakableCUDAGraphCapture(BreakableCUDAGraph()):
                pass
    _assert_clean()
    assert not graph.captured
    graph, out = _capture(lambda t: t * 2, x)  # a fresh capture works afterwards
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2)
    with pytest.raises(RuntimeError, match="reset"):
        with BreakableCUDAGraphCapture(graph):
            pass
    graph.reset()
    assert not graph.captured and graph.num_segments == 0


@pytest.mark.parametrize("where", ["segment", "break", "illegal-op"])
def test_exception_inside_capture_is_reraised_and_cleaned_up(where):
    side = torch.cuda.Stream()

    @eager_on_graph
    def brk(t):
        if where == "break":
            raise ValueError("break failed")
        return t + 1

    def forward(x):
        y = brk(x * 2)
        side.wait_stream(torch.cuda.current_stream())   # a forked stream is open when it fails
        with torch.cuda.stream(side):
            y = y + 1
        if where == "segment":
            raise ValueError("segment failed")
        if where == "illegal-op":
            y.sum().item()  # a host sync while capturing: CUDA invalidates the capture
        torch.cuda.current_stream().wait_stream(side)
        return y

    x = torch.ones(8, device="cuda")
    graph = BreakableCUDAGraph()
    stream = torch.cuda.Stream()
    capture = BreakableCUDAGraphCapture(graph, stream=stream)
    with pytest.raises((ValueError, RuntimeError)):
        with torch.no_grad(), capture:
            forward(x)
    _assert_clean()
    # An invalidated capture leaves its pool registered with torch's pinned-host allocator (no API
    # undoes that): the handle must not be captured into again.
    assert graph.pool_retired is (where == "illegal-op")
    assert not graph.captured
    with torch.cuda.stream(stream):
        assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    graph2, out = _capture(lambda t: brk(t * 2) * 3 if where != "break" else t * 3, x)
    graph2.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (x * 2 + 1) * 3 if where != "break" else x * 3)


def test_torch_compile_code_between_breaks_is_captured_as_segments():
    pytest.importorskip("triton")

    @eager_on_graph
    def brk(t):
        return torch.sin(t)

    def forward(x):
        return torch.cos(brk(x * 2 + 1)) * 3

    compiled = torch.compile(forward)
    x = torch.randn(1024, device="cuda")
    graph, out = _capture(compiled, x, warmup=2)
    assert graph.num_breaks == 1 and graph.num_segments == 2
    for _ in range(3):
        new = torch.randn(1024, device="cuda")
        x.copy_(new)
        graph.replay()
        with torch.no_grad():  # the grad mode it was compiled and captured under: same kernels
            expected = compiled(new)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


# ------------------------------------------------------------------------------------------------
# a real diffusers transformer


class _EagerProcessor:
    """Makes every call of the wrapped attention processor a break (the whole processor runs eagerly)."""

    def __init__(self, processor):
        self.processor = processor
        self.call = eager_on_graph(processor)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        return self.call(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    ).to("cuda", torch.bfloat16).eval()
    wrapped = 0
    for module in model.modules():
        if type(module).__name__ == "FluxAttention":
            module.processor = _EagerProcessor(module.processor)
            wrapped += 1
    assert wrapped == 6
    return model


def _flux_inputs(batch, height, width, text, seed):
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    return {
        "hidden_states": torch.randn(batch, height * width, 16, generator=g).to("cuda", torch.bfloat16),
        "encoder_hidden_states": torch.randn(batch, text, 32, generator=g).to("cuda", torch.bfloat16),
        "pooled_projections": torch.randn(batch, 32, generator=g).to("cuda", torch.bfloat16),
        "timestep": torch.rand(batch, generator=g).to("cuda", torch.bfloat16),
        "img_ids": img_ids.to("cuda"),
        "txt_ids": torch.zeros(text, 3, device="cuda"),
    }


def _flux_forward(model):
    def forward(inputs):
        return model(**inputs, return_dict=False)[0]

    return forward


def test_flux_replay_matches_eager_bitwise():
    model = _flux()
    forward = _flux_forward(model)
    static = _flux_inputs(1, 16, 16, 24, seed=0)
    graph, out = _capture(forward, static)
    assert (graph.num_breaks, graph.num_segments) == (6, 7)
    for seed in (1, 2, 3):
        new = _flux_inputs(1, 16, 16, 24, seed=seed)
        for name in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"):
            static[name].copy_(new[name])
        graph.replay()
        replayed = out.clone()
        with torch.no_grad():
            expected = forward(new)
        torch.cuda.synchronize()
        assert torch.isfinite(expected.float()).all()
        assert torch.equal(replayed, expected), f"seed {seed}: max diff {(replayed - expected).abs().max()}"


def test_flux_capture_pool_stays_within_1_6x_eager_peak_activation_memory():
    # The bound is what the default (expandable segments) meets today. Measured on an H200 (torch 2.11,
    # benchmarks/results/bench_pool_memory.json): eager peak 70.5 MiB, pool 104 MiB (1.48x: five 20 MiB
    # pages + 4 MiB of small blocks); the capture's live tensors peak at 74.5 MiB, the rest is the
    # caching allocator's best-fit fragmentation. 1.6x leaves room for a few 2 MiB small pages, not for
    # one more 20 MiB page (1.76x), plain segments (2.0x) or a reservation to the warm-up peak (1.68x).
    # The 1.25x target, not met, is reported by benchmarks/bench_pool_memory.py.
    # Measure: the eager forward's peak activation memory is max_memory_allocated() during the forward
    # minus what was allocated before it (weights, inputs). The graph's cost is what the allocator has
    # reserved for the capture's private pool (cudaMalloc'ed segments, read from memory_snapshot),
    # which includes the output and the bridges. Segments hold every activation the forward allocates
    # between breaks, so the pool should be about one eager peak, not one buffer per activation.
    # Sizes: batch 4 x 16384 latent tokens makes activations tens of MiB, so the allocator's segment
    # rounding (2 MiB / 20 MiB) does not decide the ratio.
    model = _flux()
    forward = _flux_forward(model)
    inputs = _flux_inputs(4, 128, 128, 64, seed=0)
    with torch.no_grad():
        forward(inputs)  # lazy initialisation (cuBLAS handles, workspaces) outside the measurement
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        eager_out = forward(inputs)
    torch.cuda.synchronize()
    eager_peak = torch.cuda.max_memory_allocated() - before
    del eager_out
    graph, out = _capture(forward, inputs)  # expandable segments (the default)
    pool = pool_reserved_bytes(graph.pool)
    print(f"eager peak activations {eager_peak / MB:.1f} MiB, capture pool {pool / MB:.1f} MiB "
          f"({pool / eager_peak:.2f}x), {graph.num_segments} segments")
    assert eager_peak > 32 * MB
    assert 0 < pool <= 1.6 * eager_peak
    # the temporary allocator setting is gone with the capture
    assert not ExpandableSegments.already_on()


def test_allocator_setting_is_restored_after_a_capture_that_raises():
    x = torch.ones(1024, device="cuda")

    def forward(t):
        t * 2  # a kernel in the open segment
        raise ValueError("boom inside the capture")

    graph = BreakableCUDAGraph()
    with pytest.raises(ValueError, match="boom"):
        with BreakableCUDAGraphCapture(graph) as capture:
            assert capture._expandable  # switched on for this capture
            forward(x)
    _assert_clean()
    assert not ExpandableSegments.already_on()
    graph, out = _capture(lambda t: t * 3, x)  # and the next capture works
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 3)


def test_raw_launch_replays_like_torch_and_keeps_random_segments_on_torch_replay():
    x = torch.randn(4096, device="cuda")

    @eager_on_graph
    def brk(t):
        return t.sin()

    def forward(t):
        a = brk(t * 2) + 1
        b = brk(a * torch.rand_like(a))  # the middle segment draws random numbers
        return b * 3

    replays = {}
    for raw in (False, True):
        torch.manual_seed(123)
        graph = BreakableCUDAGraph()
        with torch.no_grad():
            out = capture_after_warmup(graph, forward, (x,), raw_launch=raw)
        torch.manual_seed(7)
        replays[raw] = []
        for _ in range(3):
            graph.replay()
            replays[raw].append(out.clone())
        torch.cuda.synchronize()
        if raw:
            direct = [f is not s for f, s in zip(graph._fast_steps, graph._steps)]
            assert sum(direct) == 2, "the two segments without random numbers launch directly"
        assert not torch.equal(replays[raw][0], replays[raw][1]), "the random segment draws new numbers"
        graph.reset()
    for torch_replay, raw_replay in zip(replays[False], replays[True]):
        assert torch.equal(torch_replay, raw_replay)
