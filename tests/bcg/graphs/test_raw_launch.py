"""bcg.graphs.raw_launch without CUDA (the driver's launch and torch's generator stubbed): which segments a
graph launches directly after its first replay, and the fallback to torch's replay."""
import types

import pytest
import torch

from bcg.graphs.raw_launch import RawLaunch


class _Generator:
    def __init__(self):
        self.offset = 0

    def get_offset(self):
        return self.offset


class _Segment:
    def __init__(self, exec_ptr, log, generator=None):
        self.exec_ptr, self.log, self.generator = exec_ptr, log, generator

    def raw_cuda_graph_exec(self):
        return self.exec_ptr

    def replay(self):  # torch's replay: an RNG segment moves the generator's offset
        self.log.append(f"torch {self.exec_ptr}")
        if self.generator is not None:
            self.generator.offset += 4


@pytest.fixture
def driver(monkeypatch):
    generator, launches = _Generator(), []
    state = types.SimpleNamespace(generator=generator, launches=launches, result=0)

    def launch(exec_ptr, stream):
        launches.append((exec_ptr, stream))
        return state.result  # CUresult: 0 launched, anything else launched nothing

    monkeypatch.setattr(RawLaunch, "launcher", classmethod(lambda cls: launch))
    monkeypatch.setattr(torch.cuda, "default_generators", (generator,))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x5EED, raising=False)
    return state


def test_first_replay_runs_through_torch_and_later_replays_launch_segments_without_rng(driver):
    log = []
    plain, rng, last = _Segment(11, log), _Segment(22, log, driver.generator), _Segment(33, log)
    steps = (plain.replay, lambda: log.append("break"), rng.replay, last.replay)
    fast = RawLaunch.first_replay(steps, {0: plain, 2: rng, 3: last}, device_index=0)
    assert log == ["torch 11", "break", "torch 22", "torch 33"] and driver.launches == []
    assert fast[1] is steps[1] and fast[2] is steps[2]      # the break, and the segment that drew numbers
    assert fast[0] is not steps[0] and fast[3] is not steps[3]
    log.clear()
    for step in fast:
        step()
    assert log == ["break", "torch 22"] and driver.launches == [(11, 0x5EED), (33, 0x5EED)]
    driver.result = 201  # CUDA_ERROR_INVALID_CONTEXT: nothing launched, torch replays that segment
    log.clear()
    fast[0]()
    assert log == ["torch 11"] and driver.launches[-1] == (11, 0x5EED)


def test_without_a_raw_graph_exec_every_step_stays_a_torch_replay(driver):
    log = []

    class _OldTorchSegment(_Segment):
        def raw_cuda_graph_exec(self):
            raise AttributeError("raw_cuda_graph_exec")

    segment = _OldTorchSegment(44, log)
    steps = (segment.replay,)
    assert RawLaunch.first_replay(steps, {0: segment}, device_index=0) is steps
    assert log == ["torch 44"] and driver.launches == []


def test_without_the_driver_library_every_step_stays_a_torch_replay(driver, monkeypatch):
    monkeypatch.setattr(RawLaunch, "launcher", classmethod(lambda cls: None))
    log = []
    segment = _Segment(55, log)
    steps = (segment.replay,)
    assert RawLaunch.first_replay(steps, {0: segment}, device_index=0) is steps and log == ["torch 55"]
