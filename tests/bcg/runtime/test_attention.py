"""The attention kernel per shape on CPU: fallbacks with reasons, layouts, choices as trace constants."""
import pytest
import torch
import torch.nn.functional as F

from bcg.runtime.attention import AttentionDispatch, _refusal, _Shape, backend_unavailable_reason


def _qkv(layout="bhsd", b=2, h=4, s=24, d=16, kv_heads=None):
    g = torch.Generator().manual_seed(0)
    kv_heads = kv_heads or h
    shape = (lambda n, heads: (b, heads, n, d)) if layout == "bhsd" else (lambda n, heads: (b, n, heads, d))
    return (torch.randn(*shape(s, h), generator=g), torch.randn(*shape(s, kv_heads), generator=g),
            torch.randn(*shape(s, kv_heads), generator=g))


def test_sdpa_equals_torch_in_both_layouts():
    dispatch = AttentionDispatch("sdpa", device="cpu")
    q, k, v = _qkv("bhsd")
    assert torch.equal(dispatch(q, k, v), F.scaled_dot_product_attention(q, k, v))
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    out = dispatch(qs, ks, vs, layout="bshd")
    assert out.shape == qs.shape
    assert torch.equal(out.transpose(1, 2), F.scaled_dot_product_attention(q, k, v))


def test_fa3_without_cuda_falls_back_to_sdpa_with_a_reason():
    dispatch = AttentionDispatch("fa3", device="cpu")
    assert dispatch.candidates == ["sdpa"] and "CUDA" in dispatch.unavailable["fa3"]
    q, k, v = _qkv()
    assert torch.equal(dispatch(q, k, v), F.scaled_dot_product_attention(q, k, v))
    stats = dispatch.stats()
    assert stats["backend"] == "fa3" and stats["calls"] == {"sdpa": 1}  # the configured name, what ran
    assert "CUDA" in backend_unavailable_reason("fa3", torch.device("cpu"))
    assert "unknown attention backend" in backend_unavailable_reason("fastest")


def test_unknown_backend_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        AttentionDispatch("fastest")


def test_a_mask_and_grouped_heads_go_through_sdpa():
    dispatch = AttentionDispatch("math", device="cpu")
    q, k, v = _qkv(h=4, kv_heads=2)
    mask = torch.rand(2, 1, 24, 24) > 0.3
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(dispatch(q, k, v, attn_mask=mask), expected, atol=1e-5)
    assert dispatch.stats()["calls"] == {"math": 1}


def test_choices_are_recorded_per_shape():
    dispatch = AttentionDispatch("math", device="cpu")
    dispatch(*_qkv(s=24))
    dispatch(*_qkv(s=24))
    dispatch(*_qkv(s=40))
    choices = dispatch.stats()["choices"]
    assert [c["shape"] for c in choices] == ["2x4x24x24x16 float32", "2x4x40x40x16 float32"]
    assert {c["backend"] for c in choices} == {"math"} and dispatch.stats()["calls"] == {"math": 3}


def test_fa3_refuses_what_it_cannot_run():
    shape = _Shape(1, 24, 24, 4608, 4608, 128, "bfloat16")
    assert _refusal("fa3", shape, masked=False) is None
    assert "mask" in _refusal("fa3", shape, masked=True)
    assert "bf16" in _refusal("fa3", _Shape(1, 24, 24, 64, 64, 128, "float16"), masked=False)
    assert "head dim" in _refusal("fa3", _Shape(1, 24, 24, 64, 64, 320, "bfloat16"), masked=False)
    assert "mask" in _refusal("cudnn", shape, masked=True) and _refusal("efficient", shape, masked=True) is None


def test_fa3_fp8_is_named_only_and_takes_bf16_or_float8():
    from bcg.runtime.attention import AUTO_CANDIDATES, KERNELS

    assert "fa3_fp8" not in AUTO_CANDIDATES  # it changes the numbers: never chosen by "auto"
    bf16, fp8 = (_Shape(1, 24, 24, 4608, 4608, 128, dtype) for dtype in ("bfloat16", "float8_e4m3fn"))
    assert _refusal("fa3_fp8", bf16, masked=False) is None and _refusal("fa3_fp8", fp8, masked=False) is None
    assert "bf16" in _refusal("fa3", fp8, masked=False)
    assert "fa3_fp8 takes no attention mask" == _refusal("fa3_fp8", bf16, masked=True)
    dispatch = AttentionDispatch("fa3_fp8", device="cpu")
    assert dispatch.candidates == ["sdpa"] and "CUDA" in dispatch.unavailable["fa3_fp8"]
    q, k, v = (x.to(torch.float8_e4m3fn) for x in _qkv())  # handed over in float8, then refused: sdpa in bf16
    expected = F.scaled_dot_product_attention(*(x.to(torch.bfloat16) for x in (q, k, v)))
    assert torch.equal(KERNELS["sdpa"](q, k, v, None, False, None, "bhsd"), expected)


def test_compiled_code_casts_to_float8_only_when_fa3_fp8_will_take_the_call():
    dispatch = AttentionDispatch("math", device="cpu")
    q = torch.zeros(1, 24, 64, 128, dtype=torch.bfloat16)
    assert not dispatch._casts_to_fp8(q, q, None, "bhsd")  # not a candidate here
    dispatch.candidates = ["fa3_fp8"]  # as on a Hopper GPU with fa3-fwd
    assert dispatch._casts_to_fp8(q, q, None, "bhsd")
    assert not dispatch._casts_to_fp8(q, q, torch.ones(64, 64, dtype=torch.bool), "bhsd")
    assert not dispatch._casts_to_fp8(q.float(), q.float(), None, "bhsd")
    assert not dispatch._casts_to_fp8(torch.zeros(1, 24, 64, 320, dtype=torch.bfloat16), q, None, "bhsd")


def test_compiled_code_hands_fa3_fp8_float8_inputs_without_a_graph_break(monkeypatch):
    from bcg.runtime import attention

    seen = []

    def fake_fa3_fp8(query, key, value, attn_mask, is_causal, scale, layout):  # fa3-fwd needs a Hopper GPU
        seen.append(query.dtype)
        return attention._sdpa(query, key, value, attn_mask, is_causal, scale, layout)

    monkeypatch.setitem(attention.KERNELS, "fa3_fp8", fake_fa3_fp8)
    dispatch = AttentionDispatch("math", device="cpu")
    dispatch.candidates = ["fa3_fp8"]
    q, k, v = (x.to(torch.bfloat16) for x in _qkv(layout="bshd", d=32))
    compiled = torch.compile(lambda q, k, v: dispatch(q * 2, k, v, layout="bshd"), backend="aot_eager",
                             fullgraph=True)
    out = compiled(q, k, v)
    assert seen == [torch.float8_e4m3fn] and out.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(*(x.to(torch.float8_e4m3fn).to(torch.bfloat16).transpose(1, 2)
                                                for x in (q * 2, k, v))).transpose(1, 2)
    assert torch.allclose(out.float(), expected.float(), atol=1e-2)


def test_compiled_code_calls_the_dispatch_as_one_op_without_graph_breaks():
    dispatch = AttentionDispatch("math", device="cpu")
    q, k, v = _qkv()

    def attend(q, k, v):
        return dispatch(q * 2, k, v) + 1

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)  # a graph break would raise
    assert torch.allclose(compiled(q, k, v), attend(q, k, v), atol=1e-6)
    assert dispatch.stats()["choices"][0]["backend"] == "math"


def test_a_second_shape_under_automatic_dynamic_compiles_and_chooses_per_shape():
    """dynamo marks sizes dynamic when a second shape arrives (compile_dynamic=None): the dispatch is one op
    in the graph, so symbolic sizes trace, and each shape gets its own choice when the op runs."""
    dispatch = AttentionDispatch("math", device="cpu")

    def attend(q, k, v):
        return dispatch(q * 2, k, v) + 1

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True, dynamic=None)
    for tokens in (16, 24, 40):
        q, k, v = (torch.randn(1, 2, tokens, 8) for _ in range(3))
        assert torch.allclose(compiled(q, k, v), attend(q, k, v), atol=1e-6)
    assert [c["shape"].split("x")[3] for c in dispatch.stats()["choices"]] == ["16", "24", "40"]


# -- "auto" that does not depend on the load: interleaved timing, one shared choice per device and shape --

def test_interleaved_timing_keeps_each_kernels_best_round_under_a_passing_load():
    """A load during the first calls (another process compiling) would make A look slower than B if A were
    timed first and B after; interleaved, each keeps its best round and A (truly faster) wins."""
    from bcg.runtime.attention import interleaved_best

    calls = []

    def measure(name):
        calls.append(name)
        loaded = len(calls) <= 4
        return {"a": 1.0, "b": 1.1}[name] + (1.0 if loaded else 0.0)

    best = interleaved_best(measure, ["a", "b"], rounds=5)
    assert calls == ["a", "b"] * 5
    assert best == {"a": 1.0, "b": pytest.approx(1.1)}
    # a kernel that failed (inf) is measured once, never again, and never wins
    calls.clear()
    best = interleaved_best(lambda n: calls.append(n) or (float("inf") if n == "b" else 2.0), ["a", "b"], rounds=3)
    assert calls == ["a", "b", "a", "a"] and best == {"a": 2.0, "b": float("inf")}


def test_auto_on_cpu_times_two_real_kernels_interleaved():
    dispatch = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"))
    q, k, v = _qkv()
    out = dispatch(q, k, v)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5)
    (choice,) = dispatch.stats()["choices"]
    assert choice["source"] == "timed" and set(choice["ms"]) == {"sdpa", "math"}
    assert all(ms > 0 for ms in choice["ms"].values())
    assert choice["entry"] == "2x4x24x24x16 float32 causal=0 over math+sdpa"


def _timer(ms: dict, calls: list | None = None):
    """A timing function with fixed figures (CPU has no second kernel whose speed the test controls)."""
    def timer(names, shape, is_causal, device):
        if calls is not None:
            calls.append(shape.summary())
        return {n: ms[n] for n in names}
    return timer


def _never_timed(names, shape, is_causal, device):
    raise AssertionError(f"{shape.summary()} was timed, a table held its choice")


def test_choice_table_round_trips_through_json_and_is_adopted_untimed():
    import json

    from bcg.runtime.attention import CHOICES_VERSION, choice_scope

    first = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"),
                              timer=_timer({"sdpa": float("inf"), "math": 1.0}))  # sdpa failed: no figure
    for s in (24, 40):
        first(*_qkv(s=s))
    table = json.loads(json.dumps(first.export_choices()))
    assert table["version"] == CHOICES_VERSION and table["scope"] == choice_scope("cpu")
    assert {r["backend"] for r in table["choices"].values()} == {"math"} and len(table["choices"]) == 2
    second = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"), timer=_never_timed)
    assert second.import_choices(table) == 2
    for s in (24, 40):
        second(*_qkv(s=s))
    choices = second.stats()["choices"]
    assert [c["backend"] for c in choices] == ["math", "math"] and {c["source"] for c in choices} == {"coordinator"}
    assert choices[0]["ms"] == {"sdpa": None, "math": 1.0}   # the timing process's figures
    assert second.stats()["calls"] == {"math": 2}
    # what it adopted it exports again, the same choices
    assert {e: r["backend"] for e, r in second.export_choices()["choices"].items()} == \
        {e: r["backend"] for e, r in table["choices"].items()}


def test_adoption_precedence_named_backend_then_local_choice_then_table_then_timing():
    math_first = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"),
                                   timer=_timer({"sdpa": 1.0, "math": 2.0}))
    math_first(*_qkv(s=24))   # chosen here first: sdpa
    entry = math_first.stats()["choices"][0]["entry"]
    table = {"version": 1, "scope": math_first.scope,
             "choices": {entry: {"backend": "math", "ms": {}},
                         "1x1x8x8x8 float32 causal=0 over math+sdpa": {"backend": "math", "source": "store"}}}
    # a choice already made (and maybe captured) stays: first write wins here too
    assert math_first.import_choices(table) == 1
    math_first(*_qkv(s=24))
    assert math_first.stats()["choices"][0]["backend"] == "sdpa" and math_first.stats()["calls"] == {"sdpa": 2}
    # a record's own source ("store") is kept
    math_first(*(torch.randn(1, 1, 8, 8) for _ in range(3)))
    assert math_first.stats()["choices"][1]["source"] == "store"
    # a backend named explicitly is never overridden
    named = AttentionDispatch("math", device="cpu")
    assert named.import_choices({**table, "choices": {entry: {"backend": "sdpa"}}}) == 0
    named(*_qkv(s=24))
    assert named.stats()["calls"] == {"math": 1} and named.export_choices()["choices"] == {}
    # a table of another version or device is refused, naming what differs
    fresh = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"))
    with pytest.raises(ValueError, match="version 2"):
        fresh.import_choices({**table, "version": 2})
    with pytest.raises(ValueError, match="scope"):
        fresh.import_choices({**table, "scope": {"device_name": "NVIDIA H100", "torch": torch.__version__}})
    with pytest.raises(ValueError, match=r"backend must be one of"):
        fresh.import_choices({**table, "choices": {entry: {"backend": "fastest"}}})


class _FirstWins:
    """A shared table in one process: the first record published per entry holds (the coordinator's rule,
    ``deployments.attention_choices``, without Ray)."""

    def __init__(self, fail=False):
        self.held, self.fail = {}, fail

    def publish(self, scope, entry, record):
        if self.fail:
            raise ConnectionError("coordinator gone")
        mine = dict(record)
        kept = self.held.setdefault((tuple(sorted(scope.items())), entry), mine)
        return {**kept, "source": "timed" if kept is mine else "coordinator"}


def test_a_shared_table_makes_later_timers_run_the_first_published_choice():
    shared = _FirstWins()
    first = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"), timer=_timer({"sdpa": 2.0, "math": 1.0}))
    second = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"), timer=_timer({"sdpa": 1.0, "math": 2.0}))
    first.shared = second.shared = shared
    first(*_qkv())
    second(*_qkv())   # timed sdpa faster under its load, runs the published math
    (a,), (b,) = first.stats()["choices"], second.stats()["choices"]
    assert (a["backend"], a["source"]) == ("math", "timed")
    assert (b["backend"], b["source"]) == ("math", "coordinator") and b["ms_here"] == {"sdpa": 1.0, "math": 2.0}
    assert second.stats()["calls"] == {"math": 1}
    # without a table it would have kept its own
    alone = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"), timer=_timer({"sdpa": 1.0, "math": 2.0}))
    alone(*_qkv())
    assert alone.stats()["choices"][0]["backend"] == "sdpa"
    # a table that does not answer: this process's choice, and the reason counted
    lost = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"), timer=_timer({"sdpa": 1.0, "math": 2.0}))
    lost.shared = _FirstWins(fail=True)
    lost(*_qkv())
    assert lost.stats()["choices"][0]["backend"] == "sdpa" and lost.stats()["choices"][0]["source"] == "timed"
    assert any("not shared" in reason for reason in lost.stats()["fallbacks"])
