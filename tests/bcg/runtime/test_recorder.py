"""bcg.runtime.recorder without CUDA (torch's pool and stream factories stubbed): which pool handle and capture
stream the next capture takes."""
import torch

from bcg.graphs import streams as bcg_streams
from bcg.runtime.config import RunnerConfig
from bcg.runtime.recorder import CudaRecorder


def test_recorder_takes_a_fresh_pool_unless_a_live_entry_uses_it_and_leaves_streams_with_parked_graphs(
        monkeypatch):
    handles, streams, emptied = iter(range(1, 100)), iter(range(1, 100)), []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(bcg_streams, "_own_stream", lambda device: ("stream", next(streams)))
    recorder = CudaRecorder(torch.device("cuda", 0), RunnerConfig())
    recorder._prepare(live_pools=set())
    assert recorder._pool == (0, 1) and recorder._stream.stream == ("stream", 1) and emptied == []
    recorder._prepare(live_pools={(0, 1)})                  # a live entry shares the pool: keep it
    assert recorder._pool == (0, 1) and emptied == []
    # Every graph of the pool is gone: torch has freed it, and capturing into its handle would hit
    # an internal assert (use_count > 0) -- a fresh handle, and the old memory handed back.
    recorder._prepare(live_pools={(0, 7)})
    assert recorder._pool == (0, 2) and emptied == [1]
    recorder._pool_retired = True                           # a failed capture_end left it registered
    recorder._prepare(live_pools={(0, 2)})
    assert recorder._pool == (0, 3)
    assert recorder._stream.stream == ("stream", 1)
    recorder._stream.open(), recorder._stream.open()
    recorder._stream.close(["a0", "a1"])                    # an evicted graph waits on this stream
    recorder._prepare(live_pools={(0, 3)})
    assert recorder._stream.stream == ("stream", 2) and recorder._pool == (0, 3)
