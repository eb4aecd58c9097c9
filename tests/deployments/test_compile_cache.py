"""deployments.compile_cache: artifact keys, the file format (torn, foreign, corrupted), stores (local
directory, fsspec URI) and a real inductor round trip between two processes (~15 s: C++ builds)."""
import dataclasses
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from bcg.runtime.config import RunnerConfig
from deployments import compile_cache as cc
from deployments.compile_cache import (ArtifactFormatError, ArtifactKey, ArtifactStore, artifact_key, decode,
                                       encode)

REPO = Path(__file__).resolve().parents[2]


def _modules(width=8):
    torch.manual_seed(0)
    return {"transformer": nn.Sequential(nn.Linear(width, width), nn.GELU())}


def _key(config=None, shape="512x512", **kwargs):
    return artifact_key(_modules(**kwargs), config or RunnerConfig(compile=True), name="TinyPipeline",
                        shape_key=shape)


@dataclasses.dataclass(frozen=True)
class _LaterConfig(RunnerConfig):
    """RunnerConfig with a field added later (as compile_regional was)."""
    fuse_norms: bool = False


def test_key_holds_versions_device_model_dtype_and_runner_fields():
    fields = dict(_key().fields)
    assert fields["torch"] == torch.__version__
    assert fields["python"] == "%d.%d" % sys.version_info[:2]
    assert fields["device_type"] == "cpu" and "capability" in fields and "triton" in fields
    assert fields["dtype"] == "torch.float32"
    assert fields["runner.compile"] is True and "runner.compile_mode" in fields


def test_key_is_stable_and_changes_with_what_compiles():
    base = _key()
    assert base == _key() and base.digest == _key().digest
    assert _key(RunnerConfig(compile=True, compile_mode="max-autotune-no-cudagraphs")).digest != base.digest
    assert _key(width=16).digest != base.digest                    # another model config
    assert _key(shape="256x256").digest != base.digest             # per shape key
    assert _key(shape="256x256").slot != base.slot and _key(width=16).slot == base.slot


def test_capture_only_fields_leave_the_key_alone_and_new_fields_count():
    base = _key()
    assert _key(RunnerConfig(compile=True, max_entries=3, copy_outputs=False)).digest == base.digest
    later = _key(_LaterConfig(compile=True, fuse_norms=True))
    assert later.digest != base.digest
    assert any(line.startswith("runner.fuse_norms:") for line in base.diff(later))


def test_transformer_options_count_in_the_key():
    from bcg.runtime.config import TransformerOptions

    def key(options):
        return artifact_key(_modules(), RunnerConfig(compile=True), name="TinyPipeline", shape_key="512x512",
                            options=options)

    plain, fp8 = key(TransformerOptions()), key(TransformerOptions(quantize="fp8"))
    assert fp8.digest != plain.digest
    assert any(line.startswith("transformer.quantize:") for line in plain.diff(fp8))


def test_diff_names_each_field_that_differs():
    a = _key()
    b = ArtifactKey.make(a.name, a.shape_key, {**dict(a.fields), "torch": "0.0.1", "device_name": "H200"})
    diff = a.diff(b)
    assert len(diff) == 2
    assert diff[0].startswith("device_name:") and diff[1].startswith("torch:") and "'0.0.1' there" in diff[1]
    assert a.diff(a) == []


def test_encode_decode_round_trip_with_origin():
    key = _key()
    art = decode(encode(key, b"\x00payload\xff", {"replica": "r1"}), expected=key)
    assert art.key == key and art.payload == b"\x00payload\xff" and art.origin == {"replica": "r1"}


@pytest.mark.parametrize("cut", [0, 10, 60, -1])
def test_torn_artifact_is_refused(cut):
    blob = encode(_key(), b"x" * 1000)
    with pytest.raises(ArtifactFormatError, match="torn|shorter"):
        decode(blob[:cut])


@pytest.mark.parametrize("blob", [b"\x89PNG\r\n\x1a\n" + b"\x00" * 100, b"", os.urandom(4096)])
def test_foreign_bytes_are_refused(blob):
    with pytest.raises(ArtifactFormatError):
        decode(blob)


def test_corrupted_payload_fails_the_checksum():
    blob = bytearray(encode(_key(), b"y" * 100))
    blob[-5] ^= 1
    with pytest.raises(ArtifactFormatError, match="checksum"):
        decode(bytes(blob))


def test_artifact_for_another_key_is_refused_with_the_fields():
    other = _key(RunnerConfig(compile=True, compile_dynamic=False))
    with pytest.raises(ArtifactFormatError, match="runner.compile_dynamic"):
        decode(encode(other, b"z"), expected=_key())


def test_other_format_version_is_refused():
    blob = bytearray(encode(_key(), b"z"))
    blob[8:10] = (cc.FORMAT_VERSION + 1).to_bytes(2, "big")
    with pytest.raises(ArtifactFormatError, match="format version"):
        decode(bytes(blob))


# -- stores ------------------------------------------------------------------------------------------

def test_local_store_hit_miss_and_mismatch(tmp_path):
    store = ArtifactStore(str(tmp_path / "cache"))
    key = _key()
    assert store.get(key).status == "miss"
    store.put(key, encode(key, b"compiled"))
    hit = store.get(key)
    assert hit.status == "hit" and hit.artifact.payload == b"compiled"
    wanted = _key(RunnerConfig(compile=True, compile_mode="max-autotune-no-cudagraphs"))
    lookup = store.get(wanted)
    assert lookup.status == "mismatch" and lookup.artifact is None
    assert [r.split(":")[0] for r in lookup.reasons] == ["runner.compile_mode"]
    assert store.get(_key(shape="256x256")).status == "miss"   # nothing stored for that shape


def test_mismatch_reasons_come_from_the_nearest_artifact(tmp_path):
    store = ArtifactStore(str(tmp_path))
    key = _key()
    far = ArtifactKey.make(key.name, key.shape_key, {**dict(key.fields), "torch": "x", "python": "y", "dtype": "z"})
    near = ArtifactKey.make(key.name, key.shape_key, {**dict(key.fields), "torch": "x"})
    store.put(far, encode(far, b"1"))
    store.put(near, encode(near, b"2"))
    assert [r.split(":")[0] for r in store.get(key).reasons] == ["torch"]


def test_torn_file_in_store_is_ignored_with_one_warning(tmp_path, caplog):
    store = ArtifactStore(str(tmp_path))
    key = _key()
    blob = encode(key, b"p" * 500)
    target = tmp_path / key.path
    target.parent.mkdir(parents=True)
    target.write_bytes(blob[:300])
    with caplog.at_level(logging.WARNING, logger=cc.__name__):
        assert store.get(key).status == "miss"
        assert store.get(key).status == "miss"
    assert len([r for r in caplog.records if "ignoring" in r.getMessage()]) == 1
    store.put(key, blob)  # the next compile's artifacts replace the torn file
    assert store.get(key).status == "hit"


def test_foreign_file_beside_artifacts_does_not_break_lookups(tmp_path):
    store = ArtifactStore(str(tmp_path))
    key = _key()
    slot = tmp_path / key.slot
    slot.mkdir(parents=True)
    (slot / ("0" * 24 + cc.ARTIFACT_SUFFIX)).write_bytes(b"GIF89a" + os.urandom(64))
    assert store.get(key).status == "miss"


def test_failed_write_leaves_the_previous_artifact_whole(tmp_path, monkeypatch):
    store = ArtifactStore(str(tmp_path))
    key = _key()
    store.put(key, encode(key, b"old"))

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(cc.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        store.put(key, encode(key, b"new" * 1000))
    monkeypatch.undo()
    assert store.get(key).artifact.payload == b"old"
    assert sorted(p.name for p in (tmp_path / key.slot).iterdir()) == [key.digest + cc.ARTIFACT_SUFFIX]


def test_fsspec_uri_store_round_trip_and_mismatch():
    pytest.importorskip("fsspec")
    store = ArtifactStore("memory://bcg-test-cache/prefix")
    key = _key()
    store.put(key, encode(key, b"in memory"))
    assert store.get(key).artifact.payload == b"in memory"
    assert store.get(_key(RunnerConfig(compile=True, compile_dynamic=True))).reasons[0].startswith(
        "runner.compile_dynamic:")
    import fsspec
    leftovers = [p for p in fsspec.filesystem("memory").find("/bcg-test-cache") if ".tmp-" in p]
    assert leftovers == []


def test_uri_without_fsspec_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"bcg-serve\[cache\]"):
        ArtifactStore("s3://bucket/bcg")


# -- torch's artifacts -----------------------------------------------------------------------------

_ROUND_TRIP = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    from bcg.runtime.config import RunnerConfig
    from deployments.compile_cache import ArtifactStore, CompileArtifacts, artifact_key, encode
    module = torch.nn.Linear(8, 8)
    key = artifact_key({"m": module}, RunnerConfig(compile=True), name="roundtrip")
    store, artifacts = ArtifactStore(sys.argv[2]), CompileArtifacts()
    loaded = None
    if sys.argv[1] == "load":
        lookup = store.get(key)
        loaded = artifacts.load(lookup.artifact.payload)["artifacts"]
    with torch.no_grad():
        torch.compile(module, backend="inductor")(torch.randn(4, 8))
    if sys.argv[1] == "save":
        store.put(key, encode(key, artifacts.save()))
    print(json.dumps({"loaded": loaded, **counters["inductor"]}))
""")


def test_inductor_artifacts_skip_the_compile_in_a_fresh_process(tmp_path):
    def run(mode, cache_dir):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache_dir), "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", _ROUND_TRIP, mode, str(tmp_path / "store")], env=env,
                             capture_output=True, text=True, timeout=600, check=True)
        import json
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run("save", "inductor-a")
    assert first.get("fxgraph_cache_miss", 0) >= 1
    second = run("load", "inductor-b")   # a fresh inductor cache: only the artifacts can make it hit
    assert second["loaded"] >= 1
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0


def test_nearest_diff_names_the_fewest_differences_among_keys_of_the_same_model_and_shape():
    key = ArtifactKey.make("flux", "64x64", {"torch": "2.13", "mode": "default", "dynamic": False})
    one_off = ArtifactKey.make("flux", "64x64", {"torch": "2.11", "mode": "default", "dynamic": False})
    two_off = ArtifactKey.make("flux", "64x64", {"torch": "2.11", "mode": "max-autotune", "dynamic": False})
    other_shape = ArtifactKey.make("flux", "128x128", {"torch": "2.13", "mode": "default", "dynamic": False})
    assert key.nearest_diff([two_off, one_off, other_shape]) == ["torch: '2.13' here, '2.11' there"]
    assert key.nearest_diff([other_shape]) == [] and key.nearest_diff([]) == []
    assert key.nearest_diff([key, two_off]) == key.diff(two_off)  # an equal key is no mismatch
