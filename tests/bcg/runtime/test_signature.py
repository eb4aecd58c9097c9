"""Signatures: what they cover, hashing, a key that is stable across processes, summary and diff."""
import collections
import enum
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bcg.runtime.signature import Signature, signature_with_leaves, rebuild_kwargs, signature_of

REPO = Path(__file__).resolve().parents[3]


def _flux_like_kwargs(seq=64, dtype=torch.bfloat16):
    return {
        "hidden_states": torch.zeros(1, seq, 16, dtype=dtype),
        "encoder_hidden_states": torch.zeros(1, 8, 32, dtype=dtype),
        "timestep": torch.zeros(1),
        "img_ids": torch.zeros(seq, 3),
        "joint_attention_kwargs": None,
        "return_dict": False,
    }


# The key of this call is pinned in the subprocess test below; it only uses by-value parts.
_KEY_SCRIPT = """
import torch
from bcg.runtime.signature import signature_of
kw = {"x": torch.zeros(2, 3, dtype=torch.float16), "n": 4, "flag": True, "mode": "fast",
      "opts": {"scale": 0.5, "dims": (1, 2)}, "none": None}
print(signature_of(kw).key)
"""


def _key_in_this_process():
    kw = {"x": torch.zeros(2, 3, dtype=torch.float16), "n": 4, "flag": True, "mode": "fast",
          "opts": {"scale": 0.5, "dims": (1, 2)}, "none": None}
    return signature_of(kw).key


def test_key_is_identical_in_another_process():
    out = subprocess.run([sys.executable, "-c", _KEY_SCRIPT], capture_output=True, text=True, check=True,
                         cwd=REPO, env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"})
    key = out.stdout.strip().splitlines()[-1]
    assert key == _key_in_this_process()
    assert len(key) == 16 and int(key, 16) >= 0


def test_equal_calls_have_equal_hashable_signatures():
    a, b = signature_of(_flux_like_kwargs()), signature_of(_flux_like_kwargs())
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert len({a, b}) == 1
    # values of tensors and their addresses are not part of the signature
    kw = _flux_like_kwargs()
    kw["hidden_states"] = torch.randn(1, 64, 16).to(torch.bfloat16)
    assert signature_of(kw) == a


def test_keyword_order_does_not_matter():
    kw = _flux_like_kwargs()
    reordered = dict(reversed(list(kw.items())))
    assert signature_of(reordered) == signature_of(kw)
    assert signature_of(reordered).key == signature_of(kw).key


@pytest.mark.parametrize("change", [
    lambda kw: kw.update(hidden_states=torch.zeros(1, 128, 16, dtype=torch.bfloat16)),   # shape
    lambda kw: kw.update(hidden_states=torch.zeros(1, 64, 16)),                           # dtype
    lambda kw: kw.update(hidden_states=torch.zeros(1, 64, 16, 1, dtype=torch.bfloat16)),  # rank
    lambda kw: kw.update(return_dict=True),                                              # bool value
    lambda kw: kw.update(return_dict=0),                                                 # bool vs int
    lambda kw: kw.update(joint_attention_kwargs={"scale": 1.0}),                         # None vs dict
    lambda kw: kw.update(extra=1),                                                       # new argument
    lambda kw: kw.pop("img_ids"),                                                        # missing one
    lambda kw: kw.update(timestep=torch.zeros(1, device="meta")),                        # device type
])
def test_every_relevant_change_changes_the_signature(change):
    base = _flux_like_kwargs()
    kw = _flux_like_kwargs()
    change(kw)
    a, b = signature_of(base), signature_of(kw)
    assert a != b and a.key != b.key
    assert a.diff(b)  # and the difference is named


def test_scalars_are_keyed_by_type_and_value():
    sigs = [signature_of({"v": v}) for v in (1, 1.0, True, "1", None, 2, torch.float16, torch.Size([1]))]
    assert len(set(sigs)) == len(sigs)
    assert signature_of({"v": float("nan")}) == signature_of({"v": float("nan")})


def test_other_objects_are_keyed_by_identity_and_kept_alive():
    class Processor:
        pass
    p, q = Processor(), Processor()
    sp = signature_of({"processor": p})
    assert sp == signature_of({"processor": p})
    assert sp != signature_of({"processor": q})
    assert sp.has_identity_parts and signature_of({"kw": [{"p": p}]}).has_identity_parts
    assert not signature_of({"x": 1, "s": "I(x"}).has_identity_parts
    assert "Processor" in sp.summary()
    del p  # the signature holds the object, so its id cannot be reused by a new object
    assert sp != signature_of({"processor": Processor()})


def test_enums_and_namedtuples_and_ordered_dicts():
    class Mode(enum.Enum):
        A = 1
        B = 2
    Pair = collections.namedtuple("Pair", "a b")
    assert signature_of({"m": Mode.A}) != signature_of({"m": Mode.B})
    assert signature_of({"p": Pair(1, 2)}) != signature_of({"p": (1, 2)})
    od = collections.OrderedDict(a=1)
    assert signature_of({"d": od}) != signature_of({"d": {"a": 1}})


def test_summary_is_readable():
    s = signature_of(_flux_like_kwargs()).summary()
    assert "hidden_states=bfloat16[1, 64, 16]/cpu" in s
    assert "return_dict=False" in s and "joint_attention_kwargs=None" in s


def test_diff_names_shape_dtype_value_and_missing_arguments():
    base = _flux_like_kwargs(seq=64)
    other = _flux_like_kwargs(seq=128)
    other["return_dict"] = True
    other["timestep"] = torch.zeros(1, dtype=torch.float16)
    del other["joint_attention_kwargs"]
    diff = signature_of(base).diff(signature_of(other))
    assert "shape[1] 64 != 128 at hidden_states" in diff
    assert "shape[0] 64 != 128 at img_ids" in diff
    assert "dtype float32 != float16 at timestep" in diff
    assert "value False != True at return_dict" in diff
    assert "argument present != absent at joint_attention_kwargs" in diff
    assert len(diff) == 5
    assert signature_of(base).diff(signature_of(_flux_like_kwargs(seq=64))) == []


def test_diff_walks_into_containers():
    a = signature_of({"kw": {"sizes": [torch.zeros(2, 3), 4]}})
    b = signature_of({"kw": {"sizes": [torch.zeros(2, 5), 4.0]}})
    assert a.diff(b) == ["shape[1] 3 != 5 at kw['sizes'][0]", "kind int != float at kw['sizes'][1]"]
    with pytest.raises(TypeError, match="signature_of"):
        a.diff({"kw": 1})


def test_leaves_come_back_in_signature_order_and_rebuild_round_trips():
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    kw = {"b": [torch.ones(1), {"t": torch.ones(2), "n": 3}], "a": torch.ones(3),
          "o": Transformer2DModelOutput(sample=torch.ones(4))}
    sig, leaves = signature_with_leaves(kw)
    assert [t.shape[0] for t in leaves] == [3, 1, 2, 4]   # names sorted: a, b, o
    fresh = [torch.full_like(t, 7.0) for t in leaves]
    rebuilt = rebuild_kwargs(kw, fresh)
    assert list(rebuilt) == ["b", "a", "o"]               # the caller's order is kept
    assert rebuilt["a"] is fresh[0] and rebuilt["b"][0] is fresh[1] and rebuilt["b"][1]["t"] is fresh[2]
    assert rebuilt["b"][1]["n"] == 3
    assert isinstance(rebuilt["o"], Transformer2DModelOutput) and rebuilt["o"].sample is fresh[3]
    assert signature_of(rebuilt) == sig
    assert isinstance(sig, Signature)


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports itself on CUDA device `index`: device indices without a GPU."""

    index = 0

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return self.index


def _on_cuda(index, *shape):
    t = torch.Tensor._make_subclass(_OnCuda, torch.zeros(*shape))
    t.index = index
    return t


def test_cuda_tensors_are_keyed_by_device_index():
    a, b = signature_of({"x": _on_cuda(0, 2, 3)}), signature_of({"x": _on_cuda(1, 2, 3)})
    assert a == signature_of({"x": _on_cuda(0, 2, 3)})
    assert a != b and a.key != b.key
    assert "x=float32[2, 3]/cuda:1" in b.summary()
    assert a.diff(b) == ["device cuda:0 != cuda:1 at x"]
    nested_a = signature_of({"kw": [_on_cuda(0, 1)]})
    assert nested_a != signature_of({"kw": [_on_cuda(1, 1)]})     # off the inlined fast path too


def test_call_context_keys_grad_mode_and_autocast_state():
    from bcg.runtime.signature import call_context

    kw = _flux_like_kwargs()
    with torch.no_grad():
        inference = call_context()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = call_context()
    with torch.enable_grad():
        grad = call_context()
    assert inference == ()
    assert signature_of(kw, context=inference).key == signature_of(kw).key   # adds nothing
    sigs = {name: signature_of(kw, context=ctx) for name, ctx in
            (("inference", inference), ("autocast", autocast), ("grad", grad))}
    assert len(set(sigs.values())) == 3 and len({s.key for s in sigs.values()}) == 3
    assert sigs["grad"].context == {"grad": "enabled"}
    assert sigs["autocast"].context == {"autocast": "cpu:bfloat16"}
    assert sigs["grad"].summary().endswith("@grad=enabled")
    assert "@autocast=cpu:bfloat16" in sigs["autocast"].summary()
    assert sigs["inference"].diff(sigs["grad"]) == ["grad disabled != enabled"]
    assert sigs["autocast"].diff(sigs["inference"]) == ["autocast cpu:bfloat16 != off"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert signature_of(kw, context=call_context()) != sigs["autocast"]     # the dtype counts


def test_a_runner_keys_a_none_passed_for_a_none_default_as_if_it_were_left_out():
    # diffusers' WanImageToVideoPipeline passes encoder_hidden_states_image=None where WanPipeline passes nothing:
    # one call, one signature (and graph); a None where the default is something else stays part of the key
    from bcg.runtime.runner import BreakableGraphRunner

    class Block(torch.nn.Module):
        def forward(self, hidden_states, image=None, scale=1.0, *, extra=None):
            return hidden_states * scale

    runner = BreakableGraphRunner(Block())
    x = torch.zeros(2, 3)
    plain = runner.signature_of(x)
    assert runner.signature_of(x, image=None, extra=None) == plain == runner.signature_of(hidden_states=x, image=None)
    assert runner.signature_of(x, scale=None) != plain and runner.signature_of(x, image=x) != plain
    assert torch.equal(runner(x, image=None, extra=None), x)
