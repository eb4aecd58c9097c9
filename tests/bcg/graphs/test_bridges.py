"""bcg.graphs.bridges on CPU tensors: replay outputs copied in place, clear errors on a changed output, and
released bridges that the pool can reuse."""
import pytest
import torch

from bcg import BreakOutputMismatchError  # the public name: what users catch
from bcg.graphs.bridges import Bridges


def _bridges(out, name="attn_core"):
    bridges = Bridges(name, out)
    return bridges, bridges.make_copier()


def test_bridges_copy_replay_outputs_in_place():
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64)
    bridges, copy = _bridges((a, b))
    bridged_a, bridged_b = bridges.result
    assert bridged_a is not a and bridged_a.shape == a.shape and bridged_b.dtype == torch.int64
    copy((torch.ones(2, 3), torch.arange(4)))
    assert torch.equal(bridged_a, torch.ones(2, 3)) and torch.equal(bridged_b, torch.arange(4))

    single, copy_single = _bridges(torch.zeros(5))
    copy_single(torch.full((5,), 7.0))
    assert torch.equal(single.result, torch.full((5,), 7.0))

    tree, copy_tree = _bridges({"h": torch.zeros(2), "extra": [None, 3, torch.zeros(1)]})
    copy_tree({"h": torch.ones(2), "extra": [None, 3, torch.full((1,), 9.0)]})
    assert torch.equal(tree.result["h"], torch.ones(2))
    assert tree.result["extra"][0] is None and tree.result["extra"][1] == 3
    assert torch.equal(tree.result["extra"][2], torch.full((1,), 9.0))


def test_bridge_shape_dtype_or_structure_change_raises_a_clear_error():
    bridges, copy = _bridges((torch.zeros(2, 3), torch.zeros(4)))
    copy((torch.zeros(2, 3), torch.zeros(4)))
    with pytest.raises(BreakOutputMismatchError) as err:
        copy((torch.zeros(2, 5), torch.zeros(4)))
    message = str(err.value)
    assert "attn_core" in message and "output[0]" in message
    assert "(2, 3)" in message and "(2, 5)" in message
    with pytest.raises(BreakOutputMismatchError, match="float64"):
        copy((torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)))
    with pytest.raises(BreakOutputMismatchError, match="tuple of 2"):
        copy(torch.zeros(2, 3))
    with pytest.raises(BreakOutputMismatchError):
        copy((torch.ones(2, 3), torch.ones(5)))  # second output wrong: the first is not copied either
    assert torch.equal(bridges.result[0], torch.zeros(2, 3))

    tree, copy_tree = _bridges({"h": torch.zeros(2), "extra": [None, torch.zeros(1)]})
    with pytest.raises(BreakOutputMismatchError, match=r"output\['extra'\]\[0\]"):
        copy_tree({"h": torch.zeros(2), "extra": [torch.zeros(1), torch.zeros(1)]})
    with pytest.raises(BreakOutputMismatchError, match="keys"):
        copy_tree({"h": torch.zeros(2)})

    _, copy_none = _bridges(None)
    copy_none(None)
    with pytest.raises(BreakOutputMismatchError, match="NoneType"):
        copy_none(torch.zeros(1))


def test_a_python_scalar_output_that_changes_at_replay_raises_and_copies_nothing():
    bridges, copy = _bridges((torch.zeros(3), 5, "fast", 0.5))
    copy((torch.ones(3), 5, "fast", 0.5))                     # same values: copied
    assert torch.equal(bridges.result[0], torch.ones(3))
    with pytest.raises(BreakOutputMismatchError) as err:
        copy((torch.full((3,), 2.0), 7, "fast", 0.5))
    message = str(err.value)
    assert "attn_core" in message and "output[1]" in message and "int 7" in message and "int 5" in message
    assert "tensor" in message                                 # names the fix
    assert torch.equal(bridges.result[0], torch.ones(3))      # nothing copied, not even the tensor
    with pytest.raises(BreakOutputMismatchError, match=r"output\[2\]"):
        copy((torch.ones(3), 5, "slow", 0.5))
    with pytest.raises(BreakOutputMismatchError, match=r"output\[3\]"):
        copy((torch.ones(3), 5, "fast", -0.5))
    with pytest.raises(BreakOutputMismatchError, match="bool True"):
        copy((torch.ones(3), True, "fast", 0.5))               # 1 == True, but another type

    _, copy_single = _bridges(3)                               # a break that returns only a scalar
    copy_single(3)
    with pytest.raises(BreakOutputMismatchError, match="int 4"):
        copy_single(4)
    _, copy_float = _bridges({"scale": 0.0, "nan": float("nan")})
    copy_float({"scale": 0.0, "nan": float("nan")})            # NaN is the value it was captured with
    with pytest.raises(BreakOutputMismatchError, match=r"output\['scale'\]"):
        copy_float({"scale": -0.0, "nan": float("nan")})       # -0.0 == 0.0, but 1 / x differs


def test_released_bridges_drop_every_strong_reference_to_the_bridges():
    bridges = Bridges("attn", (torch.zeros(3), {"h": torch.zeros(2)}))
    assert bridges.result[1]["h"] is bridges.owned[1]
    bridges.release()
    # `result` was what the model got back at capture; holding it kept every bridge of the graph
    # allocated in the pool for the graph's lifetime (the memory later segments should reuse).
    assert bridges.owned == [] and bridges.result is None
    assert [tuple(t.shape) for t in bridges.targets] == [(3,), (2,)]


def test_unsupported_break_output_type_is_rejected_at_capture():
    with pytest.raises(TypeError, match="break outputs must be"):
        Bridges("fn", object())
