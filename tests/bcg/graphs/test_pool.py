"""bcg.graphs.pool without CUDA: the expandable-segments setting is switched on for one capture and
restored, and left alone when it is already on (the program's choice, or an overlapping capture's)."""
import torch

from bcg.graphs.pool import ExpandableSegments


def test_expandable_segments_are_switched_on_for_one_capture_and_left_alone_when_on(monkeypatch):
    calls = []
    monkeypatch.setattr(ExpandableSegments, "_setter", staticmethod(lambda: calls.append))
    monkeypatch.setattr(ExpandableSegments, "already_on",
                        staticmethod(lambda: bool(calls) and calls[-1] == "expandable_segments:True"))
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    with ExpandableSegments() as outer:
        assert outer.on and calls == ["expandable_segments:True"]
        with ExpandableSegments() as overlapping:          # finds it on: neither switches nor restores
            assert overlapping.on
        assert calls == ["expandable_segments:True"]
    assert calls == ["expandable_segments:True", "expandable_segments:False"] and not outer.on
    # another allocator backend (cudaMallocAsync): nothing is touched
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    with ExpandableSegments() as other:
        assert not other.on
    assert len(calls) == 2


def test_expandable_segments_already_on_reads_the_last_setting(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert ExpandableSegments.already_on()
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:False",
                        raising=False)
    assert not ExpandableSegments.already_on()  # the program switched it off later
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert not ExpandableSegments.already_on()
