"""The registry of what bcg installs (`bcg.runtime.hooks`): named, ordered, removable, undone completely."""
import pytest
import torch

from bcg.runtime.hooks import REGISTRY_ATTR, HookRegistry, ModelHook, bcg_hooks_on, remove_bcg_hooks


class Add(ModelHook):
    """Adds `n` to the input (pre) and records the order of calls."""

    def __init__(self, n, log):
        super().__init__()
        self.n, self.log = n, log

    def pre_forward(self, module, x):
        self.log.append(f"pre{self.n}")
        return (x + self.n,), {}

    def post_forward(self, module, output):
        self.log.append(f"post{self.n}")
        return output * 10


class Replace(ModelHook):
    """A new forward that doubles what the forward below it returns."""

    def new_forward(self, module, x):
        return 2 * self.fn_ref.original_forward(x)


class Installs(ModelHook):
    def initialize_hook(self, module):
        module.__dict__["installed"] = True
        return module

    def deinitialize_hook(self, module):
        del module.__dict__["installed"]
        return module


def _identity():
    module = torch.nn.Identity()
    return module


def test_hooks_compose_in_registration_order():
    log = []
    module = _identity()
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(Add(1, log), "one")
    registry.register_hook(Add(2, log), "two")
    out = module(torch.tensor(0.0))
    # "two" wraps "one": ((0 + 2 + 1) * 10) * 10
    assert out.item() == 300.0
    assert log == ["pre2", "pre1", "post1", "post2"]
    assert registry.names() == ["one", "two"]
    assert HookRegistry.check_if_exists_or_initialize(module) is registry


def test_removing_a_middle_hook_keeps_the_others_composed():
    log = []
    module = _identity()
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(Add(1, log), "one")
    registry.register_hook(Replace(), "double")
    registry.register_hook(Add(2, log), "two")
    assert module(torch.tensor(0.0)).item() == ((0 + 2 + 1) * 10) * 2 * 10
    registry.remove_hook("double")
    assert module(torch.tensor(0.0)).item() == ((0 + 2 + 1) * 10) * 10
    registry.remove_hook("one")
    assert module(torch.tensor(0.0)).item() == (0 + 2) * 10
    registry.remove_hook("two")
    assert module(torch.tensor(5.0)).item() == 5.0
    assert "forward" not in module.__dict__ and REGISTRY_ATTR not in module.__dict__


def test_a_new_forward_hook_above_a_removed_one_reaches_the_module():
    module = _identity()
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(Add(1, []), "one")
    registry.register_hook(Replace(), "double")
    registry.remove_hook("one")
    assert module(torch.tensor(3.0)).item() == 6.0


def test_duplicate_name_is_refused_and_names_the_registered():
    module = _identity()
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(Installs(), "bcg_x")
    with pytest.raises(ValueError, match="bcg_x"):
        registry.register_hook(Installs(), "bcg_x")


def test_install_only_hooks_leave_forward_alone_and_undo_on_removal():
    module = _identity()
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(Installs(), "bcg_x")
    assert module.__dict__["installed"] is True and "forward" not in module.__dict__
    assert registry.get_hook("bcg_x") is not None
    registry.remove_hook("bcg_x")
    assert "installed" not in module.__dict__ and REGISTRY_ATTR not in module.__dict__
    assert HookRegistry.of(module) is None


def test_registry_serves_objects_without_forward():
    class Tokenizer:
        pass

    tok = Tokenizer()
    HookRegistry.check_if_exists_or_initialize(tok).register_hook(Installs(), "bcg_tok")
    HookRegistry.check_if_exists_or_initialize(tok).register_hook(Add(1, []), "bcg_add")  # no forward: no wrap
    assert tok.installed and "forward" not in tok.__dict__
    assert remove_bcg_hooks(tok) == 2
    assert vars(tok) == {}


def test_recursive_removal_reaches_submodules_and_walk_finds_none_after():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    x = torch.randn(3, 2)
    before = model(x)
    for sub in (model, model[0], model[1][0]):
        HookRegistry.check_if_exists_or_initialize(sub).register_hook(Replace(), "bcg_double")
    # each hooked forward doubles its own output: the Sequential's, and each Linear's
    inner0, inner1 = model[0], model[1][0]
    expected = 2 * (2 * (torch.nn.functional.linear(2 * torch.nn.functional.linear(x, inner0.weight, inner0.bias),
                                                    inner1.weight, inner1.bias)))
    assert torch.allclose(model(x), expected)
    assert [name for name, _, _ in bcg_hooks_on(model)] == ["", "0", "1.0"]
    HookRegistry.of(model).remove_hook("bcg_double", recurse=True)
    assert list(bcg_hooks_on(model)) == []
    assert torch.equal(model(x), before)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_stateful_hooks_reset_last_first():
    order = []

    class Stateful(ModelHook):
        _is_stateful = True

        def __init__(self, name):
            super().__init__()
            self.name = name

        def reset_state(self, module):
            order.append(self.name)
            return module

    module = torch.nn.Sequential(torch.nn.Identity())
    HookRegistry.check_if_exists_or_initialize(module).register_hook(Stateful("a"), "a")
    HookRegistry.check_if_exists_or_initialize(module).register_hook(Stateful("b"), "b")
    HookRegistry.check_if_exists_or_initialize(module[0]).register_hook(Stateful("c"), "c")
    HookRegistry.of(module).reset_stateful_hooks()
    assert order == ["b", "a", "c"]


def test_a_wrapper_installed_above_by_someone_else_survives_removal():
    """diffusers' own registry (step caching) may wrap the forward after a bcg hook: removing the bcg hook
    leaves diffusers' wrapper in place, and the removed hook no longer acts."""
    from diffusers.hooks import HookRegistry as DiffusersRegistry
    from diffusers.hooks import ModelHook as DiffusersHook

    class Triple(DiffusersHook):
        def new_forward(self, module, x):
            return 3 * self.fn_ref.original_forward(x)

    module = torch.nn.Identity()
    HookRegistry.check_if_exists_or_initialize(module).register_hook(Replace(), "bcg_double")
    DiffusersRegistry.check_if_exists_or_initialize(module).register_hook(Triple(), "triple")
    assert module(torch.tensor(1.0)).item() == 6.0
    HookRegistry.of(module).remove_hook("bcg_double")
    assert module(torch.tensor(1.0)).item() == 3.0 and HookRegistry.of(module) is None
    DiffusersRegistry.check_if_exists_or_initialize(module).remove_hook("triple")
    assert module(torch.tensor(1.0)).item() == 1.0


class Mode(ModelHook):
    """A host flag that changes what the forward runs: named in a runner's signature of every call."""

    def __init__(self):
        super().__init__()
        self.fast = False

    def signature_context(self, module):
        return (("mode", "fast"),) if self.fast else ()

    def new_forward(self, module, input):  # (the runner calls with the forward's own argument names)
        return input if self.fast else self.fn_ref.original_forward(input)


def test_hooks_name_their_state_in_a_runners_signature_until_removed():
    from bcg.runtime.runner import BreakableGraphRunner

    module = torch.nn.Linear(4, 4)
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(Installs(), "plain")  # defines no signature_context: adds nothing
    mode = registry.register_hook(Mode(), "mode")
    runner = BreakableGraphRunner(module)
    x = torch.randn(2, 4)
    slow = runner.signature_of(x)
    mode.fast = True
    fast = runner.signature_of(x)
    assert registry.signature_context() == (("mode", "fast"),) and fast.context["mode"] == "fast"
    assert fast.key != slow.key and fast.diff(slow) == ["mode fast != unset"]
    assert torch.equal(runner(x), x)  # (eager on the CPU) the flag's forward
    registry.remove_hook("mode")
    assert registry.signature_context() == () and runner.signature_of(x) == slow
