"""The rows context (`bcg.runtime.rows`): set once around a call through the object's `HookRegistry`,
told to every hook, narrowed for a part of the call and set back; a request's leaving told to every hook."""
import pytest

from bcg.runtime.hooks import HookRegistry, ModelHook
from bcg.runtime.rows import Row, RowsContext, call_branch, release_rows, rows_context


class _Reader(ModelHook):
    """A hook that reads rows: what it was told, in order."""

    def __init__(self):
        super().__init__()
        self.seen, self.released = [], []

    def set_rows_context(self, module, ctx):
        self.seen.append(None if ctx is None else [(r.owner, r.branch, r.lora) for r in ctx.rows])

    def release(self, module, owner):
        self.released.append(owner)


class _Model:
    pass


def _ctx():
    return RowsContext(rows=(Row(owner=7, lora=("a", 1.0)), Row(owner=8, index=0, lora=None), Row(lora=None)))


def test_rows_context_is_told_to_every_hook_and_set_back_after_the_call():
    model = _Model()
    registry = HookRegistry.check_if_exists_or_initialize(model)
    first, second = registry.register_hook(_Reader(), "bcg_a"), registry.register_hook(ModelHook(), "bcg_b")
    ctx = _ctx()
    with rows_context(model, ctx) as inside:
        assert inside is ctx and registry.rows_context is ctx
    assert registry.rows_context is None
    assert first.seen == [[(7, "cond", ("a", 1.0)), (8, "cond", None), (None, "cond", None)], None]
    assert second.fn_ref is None  # a hook that only installs wraps nothing, reads nothing
    release_rows(model, 7)
    assert first.released == [7]


def test_a_part_of_the_call_is_set_for_that_part_and_the_calls_rows_come_back():
    model = _Model()
    registry = HookRegistry.check_if_exists_or_initialize(model)
    reader = registry.register_hook(_Reader(), "bcg_a")
    ctx = _ctx()
    with rows_context(model, ctx):
        with call_branch(model, "uncond"):
            part = registry.rows_context.gathered([1, 0, 0])   # as a feature narrows the rows it is called with
            with rows_context(model, part):
                part.outcome[8] = False   # a feature's decision, read by the caller through the call's context
    assert part.gather == (1, 0, 0) and [r.owner for r in part.rows] == [8, 7, 7]
    assert ctx.outcome == {8: False}
    assert [None if s is None else [o for o, _, _ in s] for s in reader.seen] == \
        [[7, 8, None], [7, 8, None], [8, 7, 7], [7, 8, None], [7, 8, None], None]
    assert [s[0][1] for s in reader.seen[:5]] == ["cond", "uncond", "uncond", "uncond", "cond"]
    assert ctx.owners() == [7, 8]


def test_without_a_registry_or_a_context_nothing_is_set():
    model = _Model()
    with rows_context(model, _ctx()) as ctx:
        assert HookRegistry.of(model) is None and ctx.rows[0].owner == 7
    with call_branch(model, "uncond"):
        pass
    release_rows(model, 7)
    release_rows(None, 7)


def test_a_hook_that_refuses_the_rows_raises_before_the_call_and_leaves_no_context():
    class Refuses(ModelHook):
        def set_rows_context(self, module, ctx):
            if ctx is not None:
                raise ValueError("no adapter 'x' is loaded")

    model = _Model()
    registry = HookRegistry.check_if_exists_or_initialize(model)
    registry.register_hook(Refuses(), "bcg_refuses")
    with pytest.raises(ValueError, match="adapter"):
        with rows_context(model, _ctx()):
            raise AssertionError("the call must not run")
    assert registry.rows_context is None
