"""bcg.graphs.pool without CUDA: the temporary expandable-segments setting is reference counted, restored,
and left alone when the program already chose it."""
import torch

from bcg.graphs.pool import ExpandableSegments


def test_expandable_segments_setting_is_reference_counted_and_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(ExpandableSegments, "_setter", staticmethod(lambda: calls.append))
    monkeypatch.setattr(ExpandableSegments, "_already_on", staticmethod(lambda: False))
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    assert ExpandableSegments.enter() and ExpandableSegments.enter()
    assert calls == ["expandable_segments:True"] and ExpandableSegments.active()
    ExpandableSegments.exit()
    assert calls == ["expandable_segments:True"]  # the other capture still holds it
    ExpandableSegments.exit()
    assert calls == ["expandable_segments:True", "expandable_segments:False"]
    assert ExpandableSegments._users == 0 and not ExpandableSegments.active()
    # another allocator backend (cudaMallocAsync) or a setting already on: nothing is touched
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert not ExpandableSegments.enter() and calls[-1] == "expandable_segments:False"


def test_expandable_segments_already_on_reads_the_last_setting(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert ExpandableSegments._already_on()
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:False",
                        raising=False)
    assert not ExpandableSegments._already_on()  # the program switched it off later
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert not ExpandableSegments._already_on()
