"""What bcg puts on objects it does not own goes through one registry (`bcg.runtime.hooks`): no class
swaps anywhere in bcg/ or deployments/, and a handful of attribute names in all (the registry's own, the
per-class memory, the runner's capture-failure hook, and the few on bcg's own functions and torch's
streams)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("bcg", "deployments") for p in (REPO / d).rglob("*.py"))
# a name that starts an identifier: "_bcg_x" or "__bcg_x__", not the "ray_bcg_..." metric names
NAME = re.compile(r"(?<![A-Za-z0-9_])_{1,2}bcg_[A-Za-z0-9_]*")
MAX_NAMES = 6


def _names() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in SOURCES:
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def test_sources_are_found():
    assert len(SOURCES) > 40 and any(p.name == "hooks.py" for p in SOURCES)


def test_no_class_is_swapped():
    swaps = [str(p.relative_to(REPO)) for p in SOURCES
             if re.search(r"__class__\s*=|[\"']__class__[\"']\s*,", p.read_text())]
    assert swaps == []


def test_few_bcg_attribute_names():
    names = _names()
    assert "_bcg_hooks" in names and "__bcg_class_memory__" in names  # the registry's and the class memory's
    assert len(names) <= MAX_NAMES, {n: sorted(set(p)) for n, p in names.items()}


def test_the_name_count_sees_a_new_name():
    # the pattern counts what the rule is about: a private bcg attribute, not a metric named ray_bcg_*
    assert NAME.findall('setattr(obj, "_bcg_new", 1); x.__bcg_other__ = 2; "ray_bcg_requests_total"') == [
        "_bcg_new", "__bcg_other__"]
