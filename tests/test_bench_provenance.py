"""Every result file names the code that produced it: `_common.write_json` records ``source`` (commit, clean,
and on a dirty tree the diff's hash and paths), from real git in a temporary repository."""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
import _common  # noqa: E402


def _git(repo, *cmd) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *cmd],
                          check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / "b.py").write_text("y = 1\n")
    _git(repo, "add", "a.py", "b.py")
    _git(repo, "commit", "-qm", "a")
    return repo


def _written(tmp_path, repo) -> dict:
    """What a benchmark's result file records, written as the benchmarks write it (one state per process:
    the cache is cleared to stand for a new run)."""
    _common._run_source.cache_clear()
    path = tmp_path / "result.json"
    _common.write_json(path, {"benchmark": "x", "ms": 1.5}, repo=str(repo))
    result = json.loads(path.read_text())
    assert result["benchmark"] == "x" and result["ms"] == 1.5
    return result["source"]


def test_a_result_from_a_clean_tree_records_its_commit_and_clean(tmp_path, repo, capsys):
    (repo / "out").mkdir()
    (repo / "out" / "log.txt").write_text("a run's output")  # outputs under out/ and results/ are not code
    os.makedirs(repo / "benchmarks" / "results")
    (repo / "benchmarks" / "results" / "new.json").write_text("{}")
    source = _written(tmp_path, repo)
    assert source == {"commit": _git(repo, "rev-parse", "HEAD").strip(), "clean": True, "dirty_paths": [],
                      "diff_sha256": None, "reason": None}
    assert "dirty" not in capsys.readouterr().err


def test_a_result_from_a_dirty_tree_records_the_diff_hash_and_says_so(tmp_path, repo, capsys):
    head = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "a.py").write_text("x = 2\n")
    source = _written(tmp_path, repo)
    diff = subprocess.run(["git", "-C", str(repo), "diff", "--binary", "HEAD"], check=True,
                          capture_output=True).stdout
    assert source["commit"] == head and source["clean"] is False and source["dirty_paths"] == ["a.py"]
    assert source["diff_sha256"] == hashlib.sha256(diff).hexdigest()
    warning = [line for line in capsys.readouterr().err.splitlines() if "dirty tree" in line]
    assert len(warning) == 1 and head in warning[0] and source["diff_sha256"] in warning[0]
    assert re.search(r"\b1 files differ", warning[0])

    # an untracked source file is code the commit lacks: dirty, and its bytes change the hash
    (repo / "c.py").write_text("z = 1\n")
    with_new = _written(tmp_path, repo)
    assert with_new["dirty_paths"] == ["a.py", "c.py"] and with_new["diff_sha256"] != source["diff_sha256"]
    (repo / "c.py").unlink()
    (repo / "b.py").unlink()  # a deletion is a change too
    assert _written(tmp_path, repo)["dirty_paths"] == ["a.py", "b.py"]
    _git(repo, "checkout", "-q", "--", "a.py", "b.py")
    assert _written(tmp_path, repo)["clean"] is True


def test_a_same_diff_gives_the_same_hash_in_a_copy(tmp_path, repo):
    """The GPU host measures a copy of the working tree: its hash matches the one taken here."""
    (repo / "a.py").write_text("x = 3\n")
    here = _common.source_state(str(repo))
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    assert _common.source_state(str(copy)) == here


def test_without_git_the_fields_are_null_with_a_reason(tmp_path, repo, monkeypatch):
    plain = tmp_path / "plain"  # a copied tree without .git
    shutil.copytree(repo, plain, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.delenv("BCG_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp_path either
    source = _written(tmp_path, plain)
    assert source["commit"] is None and source["clean"] is None and "BCG_COMMIT" in source["reason"]
    monkeypatch.setenv("BCG_COMMIT", "abc123")
    source = _common.source_state(str(plain))
    assert source["commit"] == "abc123" and source["clean"] is None and source["reason"]
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no git at all
    monkeypatch.delenv("BCG_COMMIT")
    source = _common.source_state(str(repo))
    assert source["commit"] is None and source["clean"] is None and source["reason"]



def test_a_stamp_names_the_commit_where_a_copy_carries_stale_git_metadata(tmp_path, repo):
    """The GPU host runs a copy of the tree whose .git may be an older one: the stamp written before the tree
    was sent names the commit while the copy's files hash as they did; an edited file makes git answer."""
    (repo / ".gitignore").write_text(_common.STAMP + "\n")
    _git(repo, "add", ".gitignore")
    _git(repo, "commit", "-qm", "ignore the stamp")
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)                    # the host's copy: its .git stays at this commit
    (repo / "a.py").write_text("x = 4\n")
    _git(repo, "commit", "-qam", "b")
    head = _git(repo, "rev-parse", "HEAD").strip()
    stamp = _common.write_stamp(str(repo))
    assert stamp["commit"] == head and stamp["clean"] is True and stamp["paths"] == [".gitignore", "a.py", "b.py"]
    assert _common.source_state(str(repo))["commit"] == head           # here too, stamp and git agree
    for name in ("a.py", _common.STAMP):                                # the tree sent over the stale copy
        shutil.copy(repo / name, copy / name)
    assert _common.source_state(str(copy), use_stamp=False)["commit"] != head   # what the copy's git says
    source = _common.source_state(str(copy))
    assert (source["commit"], source["clean"], source["dirty_paths"]) == (head, True, [])
    assert _common.STAMP in source["reason"]
    (copy / "b.py").write_text("y = 2\n")                               # edited after the stamp
    source = _common.source_state(str(copy))
    assert source["commit"] != head and source["clean"] is False and "other files" in source["reason"]
