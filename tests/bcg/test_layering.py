"""The layers of docs/architecture.md, checked: the capture core and the runner import no diffusers, no
Ray and nothing of the integration; nothing in bcg/ imports Ray."""
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
import bcg.graphs.capture, bcg.graphs.pool, bcg.graphs.bridges, bcg.graphs.streams
import bcg.runtime.runner, bcg.runtime.compile, bcg.runtime.hostops, bcg.runtime.signature
print(json.dumps(sorted({m.split('.')[0] if not m.startswith('bcg.') else '.'.join(m.split('.')[:2]) for m in sys.modules})))
"""


def test_capture_core_and_runner_import_no_diffusers_ray_or_integration():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": ""})
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "torch" in loaded and "bcg.runtime" in loaded
    assert not loaded & {"diffusers", "transformers", "ray", "bcg.diffusers"}, loaded


def test_no_module_of_bcg_imports_ray_and_the_core_never_imports_the_integration():
    ray_import = re.compile(r"^\s*(import ray|from ray\b)", re.M)
    integration_import = re.compile(r"^\s*(import bcg\.diffusers|from bcg\.diffusers|from bcg import diffusers)", re.M)
    for path in (REPO / "bcg").rglob("*.py"):
        text = path.read_text()
        assert not ray_import.search(text), path
        if path.parent.name in ("graphs", "runtime"):
            assert not integration_import.search(text), path
