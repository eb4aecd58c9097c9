"""RunnerConfig.compile_precompile: artifacts saved by one process carry dynamo's traced frames, so a fresh
process that loads them runs the compiled regions without tracing or compiling (CPU, inductor, two
subprocesses with their own inductor caches)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytestmark = [
    pytest.mark.skipif(not hasattr(torch._dynamo.config, "caching_precompile"),
                       reason="this torch has no dynamo caching precompile"),
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                       reason="inductor on the CPU needs a C++ compiler"),
]

SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from bcg.runtime.compile import compile_for_segments

    @torch.compiler.disable
    def brk(t):  # an eager break between two compiled graphs of each block, as the runners place them
        return t * 1.0

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        def forward(self, x):
            h = brk(self.up(self.norm(x)))
            return x + self.down(torch.nn.functional.gelu(h))

    class Model(torch.nn.Module):  # three blocks of one class: one regional compile serves them all
        _repeated_blocks = ["Block"]
        def __init__(self):
            super().__init__()
            self.blocks, self.proj_out = torch.nn.ModuleList(Block() for _ in range(3)), torch.nn.Linear(16, 4)
        def forward(self, x):
            return self.proj_out(self.blocks[2](self.blocks[1](self.blocks[0](x))))

    mode, path, weights = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = Model().eval()
    dtype = torch.float32
    if weights == "float8":  # the plain float8 form (bcg.runtime.float8_linear): ordinary tensors for dynamo
        from bcg.runtime.float8_linear import install_float8_linears
        model, dtype = model.to(torch.bfloat16), torch.bfloat16
        install_float8_linears(model, {id(m) for b in model.blocks for m in (b.up, b.down)})
    if mode == "load":
        with open(path, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    compiled = compile_for_segments(model, regional=True, precompile=True)
    out = compiled(torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)).float()
    if mode == "save":
        with open(path, "wb") as f:
            f.write(torch.compiler.save_cache_artifacts()[0])
    stats = compiled.stats()
    print(json.dumps({"graphs": stats["graphs_compiled"], "precompile": stats["precompile"], "out": out.flatten().tolist()}))
''')


def _run(tmp_path, mode, weights="float32"):
    # a file both processes run (dynamo finds a precompiled frame's code by its module)
    script = tmp_path / "precompiled_model.py"
    if not script.exists():
        script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{mode}"),
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "artifacts.bin"), weights], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["float32", "float8"])
def test_a_process_that_loads_precompiled_artifacts_compiles_nothing_and_computes_the_same(tmp_path, weights):
    """float8: the plain form's weights (not torchao's tensor subclass, which the precompile cannot copy)."""
    first = _run(tmp_path, "save", weights)
    assert first["precompile"] is True and first["graphs"] >= 2  # each block: before and after its break
    second = _run(tmp_path, "load", weights)  # a fresh inductor cache: only the artifacts carry the compiled code
    assert second["precompile"] is True and second["graphs"] == 0
    assert second["out"] == first["out"]


def test_precompile_needs_inductor():
    from bcg.runtime.compile import compile_for_segments
    with pytest.raises(ValueError, match="precompile needs backend='inductor', got 'eager'"):
        compile_for_segments(torch.nn.Linear(2, 2), backend="eager", precompile=True)


def test_float8_weights_turn_the_precompile_off_for_their_forward_alone(caplog):
    # torch's caching precompile makes empty_like copies of parameters, which torchao's Float8Tensor lacks
    # (every capture of FLUX.1-dev failed on the H100): a runner of float8 weights compiles without it, says so
    # once, and traces without it even while another forward of the process has turned it on
    from bcg.runtime.config import RunnerConfig
    from bcg.runtime.hooks import HookRegistry
    from bcg.runtime.quantize import HOOK_NAME, QuantizeHook, QuantizeReport
    from bcg.runtime.runner import BreakableGraphRunner

    seen = []

    @torch.compiler.disable
    def note(t):
        seen.append(bool(torch._dynamo.config.caching_precompile))
        return t

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return note(self.linear(x)) * 2

    model = Model()
    HookRegistry.check_if_exists_or_initialize(model).register_hook(  # as quantize_module leaves a float8 model
        QuantizeHook(QuantizeReport(mode="fp8", applied=True, layers=1)), HOOK_NAME)
    before = torch._dynamo.config.caching_precompile
    try:
        with caplog.at_level("WARNING", logger="bcg.runtime.runner"):
            runner = BreakableGraphRunner(model, config=RunnerConfig(compile=True, compile_precompile=True))
        assert runner.stats()["compile"]["precompile"] is False
        assert "compile_precompile is off for Model" in caplog.text and "Float8Tensor" in caplog.text
        assert "the 'plain' form can" in caplog.text
        torch._dynamo.config.caching_precompile = True  # another runner's
        torch._dynamo.reset()
        with torch.no_grad():
            runner._compiled(x=torch.randn(2, 8))
        assert seen == [False]
    finally:
        torch._dynamo.config.caching_precompile = before
        torch._dynamo.reset()
