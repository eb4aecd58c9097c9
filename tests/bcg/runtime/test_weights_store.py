"""`WeightsStore`: a module's state written once, atomically, and loaded as it is into a module built
without weights; a torn, foreign or other-key file is a miss. On CPU with a real diffusers transformer's
state (float8 itself needs a GPU: tests/bcg/diffusers/test_quantized_load_gpu.py)."""
import dataclasses
import logging
import os
import threading

import pytest
import torch

from bcg.diffusers.models import load_pipeline
from bcg.runtime.weights_store import WeightsKey, WeightsStore, open_weights_store


@pytest.fixture(scope="module")
def transformer():
    return load_pipeline("tiny-flux").transformer


def _empty_like(module):
    from accelerate import init_empty_weights

    with init_empty_weights():
        return type(module).from_config(module.config)


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


KEY = WeightsKey.make("tiny-flux/transformer", {"quantize": "fp8", "torch": torch.__version__})


def test_a_stored_state_reloads_into_a_module_built_without_weights(transformer, tmp_path):
    store = WeightsStore(str(tmp_path))
    assert store.load_into(_empty_like(transformer), KEY) is None  # a miss: nothing stored yet
    assert store.put(KEY, transformer, {"report": {"layers": 3}})
    empty = _empty_like(transformer)
    assert all(p.is_meta for p in empty.parameters())
    meta = store.load_into(empty, KEY, device="cpu")
    assert meta["report"] == {"layers": 3} and meta["seconds"] > 0 and meta["path"].endswith(KEY.path)
    assert not any(t.is_meta for t in [*empty.parameters(), *empty.buffers()])
    assert _same_state(empty, transformer)
    x = torch.randn(1, 16, transformer.config.in_channels)
    kwargs = dict(hidden_states=x, encoder_hidden_states=torch.randn(1, 8, transformer.config.joint_attention_dim),
                  pooled_projections=torch.randn(1, transformer.config.pooled_projection_dim),
                  timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3),
                  guidance=torch.tensor([3.5]) if transformer.config.guidance_embeds else None)
    with torch.no_grad():
        assert torch.equal(empty(**kwargs).sample, transformer(**kwargs).sample)


def test_non_persistent_buffers_travel_with_the_state(tmp_path):
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("offset", torch.arange(4.0), persistent=False)

    module = WithBuffer()
    module.linear.weight.requires_grad_(False)  # as torchao leaves a quantized weight
    store = WeightsStore(str(tmp_path))
    store.put(KEY, module)
    with torch.device("meta"):
        empty = WithBuffer()
    assert store.load_into(empty, KEY) is not None
    assert torch.equal(empty.offset, module.offset) and "offset" not in empty.state_dict()
    assert not empty.linear.weight.requires_grad and empty.linear.bias.requires_grad


def test_the_first_write_wins_and_racing_writers_leave_one_whole_file(transformer, tmp_path):
    store = WeightsStore(str(tmp_path))
    wins, barrier = [], threading.Barrier(4)

    def write():
        barrier.wait()
        wins.append(store.put(KEY, transformer))

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False, False, False, True]
    folder = os.path.dirname(os.path.join(str(tmp_path), KEY.path))
    assert os.listdir(folder) == [os.path.basename(KEY.path)]  # no temporary file left behind
    assert store.load_into(_empty_like(transformer), KEY) is not None


def test_a_torn_foreign_or_other_key_file_is_a_miss_with_a_warning(transformer, tmp_path, caplog):
    store = WeightsStore(str(tmp_path))
    other = WeightsKey.make("tiny-flux/transformer", {"quantize": "fp8", "torch": "0.0"})
    store.put(other, transformer)
    path = os.path.join(str(tmp_path), KEY.path)
    whole = open(os.path.join(str(tmp_path), other.path), "rb").read()
    caplog.set_level(logging.WARNING, "bcg.runtime.weights_store")
    cases = {"made for another key": whole, "": whole[: len(whole) // 2], "foreign": b"not a weights file"}
    for reason, data in cases.items():
        with open(path, "wb") as f:
            f.write(data)
        caplog.clear()
        module = load_pipeline("tiny-flux").transformer
        before = {k: v.clone() for k, v in module.state_dict().items()}
        assert store.load_into(module, KEY) is None
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # left as it was
        assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()
    assert "torch: '" in "; ".join(KEY.diff(other))


def test_the_key_names_every_field_and_its_digest_follows_them():
    a = WeightsKey.make("m/transformer", {"torchao": "0.18", "capability": "9.0", "files": [["a", 1, 2]]})
    b = WeightsKey.make("m/transformer", {"torchao": "0.18", "capability": "8.9", "files": [["a", 1, 2]]})
    assert a.digest != b.digest and a.path != b.path
    assert a.diff(b) == ["capability: '9.0' here, '8.9' there"]
    assert WeightsKey.make("m/transformer", dict(a.fields)) == a  # JSON values compare equal after a round trip
    assert open_weights_store(None) is None and open_weights_store("off") is None


def test_a_store_behind_a_uri_reads_through_a_local_copy(transformer, tmp_path):
    pytest.importorskip("fsspec")
    root = f"memory://bcg-weights-{os.getpid()}"
    store = WeightsStore(root, cache_dir=str(tmp_path / "copies"))
    assert store.put(KEY, transformer) and not store.put(KEY, transformer) and store.has(KEY)
    empty = _empty_like(transformer)
    meta = store.load_into(empty, KEY)
    assert meta["path"].startswith(str(tmp_path / "copies")) and _same_state(empty, transformer)


@dataclasses.dataclass
class Granularity:
    """Stands in for what a quantized tensor carries beside its data (torchao's ``PerRow()``)."""

    axis: int = -1


def test_classes_an_entry_holds_load_only_from_trusted_packages(tmp_path, caplog):
    module = torch.nn.Linear(4, 4)
    WeightsStore(str(tmp_path)).put(KEY, module, {"granularity": Granularity()})
    trusting = WeightsStore(str(tmp_path), trusted=("tests.",))
    meta = trusting.load_into(torch.nn.Linear(4, 4), KEY)
    assert meta["granularity"] == Granularity()
    caplog.set_level(logging.WARNING, "bcg.runtime.weights_store")
    assert WeightsStore(str(tmp_path)).load_into(torch.nn.Linear(4, 4), KEY) is None  # torchao's alone by default
    assert "untrusted" in caplog.records[-1].getMessage() and "Granularity" in caplog.records[-1].getMessage()
