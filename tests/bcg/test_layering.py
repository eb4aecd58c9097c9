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
import bcg.runtime.runner, bcg.runtime.compile, bcg.runtime.proxy, bcg.runtime.signature
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


def _imports_of(path: Path, package_root: Path) -> set[str]:
    """The bcg/deployments modules `path` imports, at module level or inside functions."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    modules = set()
    for name in found:
        if name.split(".")[0] not in ("bcg", "deployments"):
            continue
        file = package_root / (name.replace(".", "/") + ".py")
        package = package_root / name.replace(".", "/") / "__init__.py"
        modules |= {name} if file.exists() or package.exists() else set()
    return modules


def test_no_two_modules_import_each_other_even_inside_functions():
    graph = {}
    for top in ("bcg", "deployments"):
        for path in (REPO / top).rglob("*.py"):
            if path.name == "__init__.py":  # a package's re-exports, not a concept's dependencies
                continue
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            graph[name] = {m for m in _imports_of(path, REPO) if m != name}
    state, cycles = {}, []

    def visit(name, stack):
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []
