"""GPU: float8 linears (torchao) under the runner -- captured, compiled, and close to bf16."""
import pytest
import torch

from bcg.runtime.config import RunnerConfig
from bcg.runtime.quantize import fp8_unavailable_reason, quantize_module
from bcg.runtime.runner import BreakableGraphRunner

pytestmark = pytest.mark.gpu


def _needs_fp8():
    reason = fp8_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256),
                               torch.nn.LayerNorm(256), torch.nn.Linear(256, 24)).cuda().to(torch.bfloat16).eval()


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def replays_as_eager(runner, model, x):
    """`model(x)` eagerly; then `runner` warmed on `x` replays it once, with no eager call, bit for bit."""
    with torch.no_grad():
        eager = model(x)
        with runner.warmup():
            runner(x)
        before = runner.stats()["replays"]
        replayed = runner(x)
    assert runner.stats()["replays"] == before + 1 and runner.stats()["eager_calls_total"] == 0
    assert torch.equal(replayed, eager)
    return eager


def test_fp8_replay_equals_fp8_eager_and_is_close_to_bf16():
    _needs_fp8()
    reference_model = small_model()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = reference_model(x)
    model = small_model()
    report = quantize_module(model, "fp8").as_dict()
    runner = BreakableGraphRunner(model, config=RunnerConfig())
    assert report["applied"] and report["layers"] == 2 and report["skipped"] == 1  # 24 outputs: not a multiple of 16
    assert report["weight_bytes_after"] < report["weight_bytes_before"]
    eager = replays_as_eager(runner, model, x)
    assert cosine(eager, reference) > 0.99


def test_fp8_leaves_inductor_settings_alone():
    """torchao's default turns on coordinate-descent tuning for every later compile in the process (about 180 s
    more on a FLUX.1-dev regional compile's first call); quantizing must not change inductor's settings."""
    _needs_fp8()
    import torch._inductor.config as inductor_config

    before = {name: getattr(inductor_config, name) for name in
              ("coordinate_descent_tuning", "coordinate_descent_check_all_directions", "force_fuse_int_mm_with_mul")}
    model = small_model()
    assert quantize_module(model, "fp8").applied
    assert {name: getattr(inductor_config, name) for name in before} == before


def test_fp8_compiled_regional_segments_are_close_to_fp8_eager():
    _needs_fp8()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = Net().cuda().to(torch.bfloat16).eval()
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    eager_model = Net().cuda().to(torch.bfloat16).eval()
    eager_model.load_state_dict(model.state_dict())
    quantize_module(eager_model, "fp8")
    with torch.no_grad():
        expected = eager_model(x)
    quantize_module(model, "fp8")
    runner = BreakableGraphRunner(model, config=RunnerConfig(compile=True, compile_regional=True))
    with torch.no_grad():
        with runner.warmup():
            runner(x)
        out = runner(x)
    stats = runner.stats()
    assert stats["eager_calls_total"] == 0 and stats["compile"]["regional"] == ["Block"]
    assert stats["compile"]["graphs_compiled"] >= 1
    assert cosine(out, expected) > 0.999
