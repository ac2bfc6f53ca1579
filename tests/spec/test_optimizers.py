"""A spec and its optimizers: frozen parameters out (or refused, changing nothing), a thawed
group in once, by identity, with its settings, into the optimizer it names."""

from __future__ import annotations

import warnings

import pytest
import torch

import isolate
from isolate import IsolationSpec, Thaw
from isolate.errors import (
    CheckpointMismatchError,
    IsolationTypeError,
    SpecError,
)
from isolate.spec.optimizers import add_group
from tests.spec._models import SPEC, Net, assert_same, groups_of, state_of

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def test_an_optimizer_refused_leaves_model_and_optimizer_as_they_were() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    before, groups = state_of(model), groups_of(opt)
    spec = IsolationSpec(freeze=["trunk"], frozen_in_optimizer="error")
    with pytest.raises(SpecError, match=r"^IsolationSpec: 6 frozen parameters sit in an optimizer"):
        spec.apply(model, optimizer=opt)
    assert_same(before, state_of(model))
    assert groups_of(opt) == groups


def test_a_thaw_adds_the_group_once_by_identity_with_its_settings() -> None:
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters()], lr=0.1, momentum=0.9)
    handle = SPEC.apply(model, optimizer=opt)
    assert [len(g) for g in groups_of(opt)] == [4]  # the 6 frozen parameters are out
    assert handle.step(epoch=0, step=5) == []
    assert handle.step(epoch=1, step=6) == ["trunk.3"]
    last = opt.param_groups[-1]
    assert [id(p) for p in last["params"]] == [id(model.trunk[3].weight), id(model.trunk[3].bias)]
    assert last["lr"] == 0.5 and last["momentum"] == 0.9
    with pytest.raises(SpecError, match=r"thaw group 'trunk.3' was thawed already .*thawed once"):
        handle.thaw("trunk.3")
    with pytest.raises(SpecError, match=r"no thaw group 'trunk'; the groups are \['trunk.3'\]"):
        handle.thaw("trunk")
    assert handle.step(epoch=2, step=7) == []
    assert sum(len(g) for g in groups_of(opt)) == 6
    handle.restore()


def test_an_optimizer_built_before_the_spec_gives_up_its_frozen_parameters_quietly() -> None:
    """Lightning's ModelParallelStrategy applies the spec after configure_optimizers: the
    optimizer cannot help holding what the spec freezes, so taking them out is no news."""
    before, after = Net(), Net()
    early = torch.optim.AdamW(before.parameters(), lr=0.1, weight_decay=0.1)
    quiet, loud = SPEC.apply(before), SPEC.apply(after)
    late = torch.optim.AdamW(after.parameters(), lr=0.1, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.attach(early, built_before_apply=True)
    assert [str(w.message) for w in caught] == []
    with pytest.warns(isolate.IsolationWarning, match=r"took 6 frozen parameters out"):
        loud.attach(late)  # built from a frozen model's parameters: worth a warning
    for model, opt in ((before, early), (after, late)):
        trainable = [id(p) for p in model.parameters() if p.requires_grad]
        assert groups_of(opt) == [trainable]  # taken out either way
    quiet.restore()
    loud.restore()


def test_thaw_takes_an_optimizer_and_an_lr() -> None:
    model = Net()
    first = torch.optim.SGD(model.head.parameters(), lr=0.1)
    second = torch.optim.SGD(model.aux.parameters(), lr=0.2)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", step=2, lr=0.5, optimizer_idx=0)])
    handle = spec.apply(model, optimizer=[first, second])
    group = handle.thaw("trunk.3", optimizer=second, lr=0.01)
    assert group is second.param_groups[-1] and group["lr"] == 0.01
    assert len(first.param_groups) == 1
    handle.restore()
    assert len(second.param_groups) == 1


def test_thaw_refuses_an_optimizer_object_that_is_not_attached() -> None:
    model = Net()
    first = torch.optim.SGD(model.head.parameters(), lr=0.1)
    stranger = torch.optim.SGD(model.aux.parameters(), lr=0.2)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", step=2, lr=0.5)])
    handle = spec.apply(model, optimizer=first)
    try:
        with pytest.raises(SpecError, match=r"not one of the 1 attached optimizers"):
            handle.thaw("trunk.3", optimizer=stranger)
        assert len(first.param_groups) == 1 and len(stranger.param_groups) == 1
        assert handle.thawed == ()
    finally:
        handle.restore()


def test_the_warning_names_each_param_group_with_why_a_zero_gradient_moves_it() -> None:
    model = Net()
    decaying = torch.optim.ASGD(model.trunk[0].parameters(), lr=0.1, weight_decay=0.1)
    sparse = torch.optim.SparseAdam([*model.trunk[3].parameters(), *model.head.parameters()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = IsolationSpec(freeze=["trunk.0", "trunk.3"]).apply(
            model, optimizer=[decaying, sparse]
        )
    try:
        assert [str(w.message) for w in caught] == [
            "IsolationSpec: took 4 frozen parameters out of the optimizers, where a zero "
            "gradient with weight decay or momentum could move them; a thaw step adds them "
            "back as a new param group:\n"
            "  optimizer 0, param group 0 (weight_decay=0.1 shrinks it on every step; "
            "lambd=0.0001 (ASGD) shrinks it on every step): ['trunk.0.weight', 'trunk.0.bias']\n"
            "  optimizer 1, param group 0 (no weight decay or optimizer state moves it now): "
            "['trunk.3.weight', 'trunk.3.bias']\n"
            "To silence this, build the optimizer from trainable parameters only."
        ]
    finally:
        handle.restore()


def test_add_group_refuses_a_parameter_the_optimizer_holds_or_a_scheduler_it_cannot_extend() -> (
    None
):
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with pytest.raises(
        SpecError,
        match=r"^add_group\(\): 1 of the parameters are already in the optimizer; a parameter "
        r"must be in one param group only$",
    ):
        add_group(opt, [model.aux.weight, model.head.bias], {"lr": 0.2})

    class Mine(torch.optim.lr_scheduler.LRScheduler):
        def get_lr(self) -> list[float]:
            return list(self.base_lrs)

    with pytest.raises(SpecError, match=r"^add_group\(\): the LR scheduler Mine cannot schedule"):
        add_group(opt, [model.aux.weight], {"lr": 0.2}, [Mine(opt)])
    assert groups_of(opt) == [[id(model.head.weight), id(model.head.bias)]]


def test_a_second_attach_with_other_optimizers_names_both_by_type() -> None:
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    handle = IsolationSpec(freeze=["trunk"]).apply(model, optimizer=opt)
    try:
        with pytest.raises(
            SpecError,
            match=r"^IsolationSpec\.attach\(\): already attached to 1 optimizer\(s\) \['SGD'\], "
            r"and given \['SGD', 'AdamW'\]; the first attach",
        ):
            handle.attach([opt, torch.optim.AdamW(model.aux.parameters())])
    finally:
        handle.restore()


@pytest.mark.parametrize("kind", ["config", "none", "stale"])
def test_a_scheduler_that_drives_none_of_the_optimizers_is_refused_changing_nothing(
    kind: str,
) -> None:
    """A Lightning-style config dict, ``None``, or a scheduler left on an optimizer since
    rebuilt would never schedule a thawed group (a LambdaLR then breaks at its next step)."""
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    old = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.head.parameters()), abs)
    given = {"config": {"scheduler": sched}, "none": None, "stale": old}[kind]
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=0.5)])
    handle = spec.apply(model)
    try:
        with pytest.raises(SpecError) as error:
            handle.attach(opt, [sched, given])
        assert str(error.value) == (
            f"IsolationSpec.attach(): schedulers[1] is {given!r}, which drives none of the "
            f"attached optimizers ['SGD'], so a thawed group would never join its schedule; "
            f"pass each LR scheduler itself (a Lightning config's 'scheduler', not the "
            f"config), built on an optimizer given to attach()"
        )
        handle.attach(opt, [sched])  # nothing was attached: this is the first attach
        with pytest.raises(SpecError, match=r"^IsolationSpec\.attach\(\): schedulers\[0\] is"):
            handle.attach(opt, [given])  # a second attach checks the new ones too
        assert handle.step(epoch=1, step=1) == ["trunk.3"]
        assert sched.base_lrs == [0.1, 0.5] and [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    finally:
        handle.restore()


def test_a_lone_scheduler_is_one_and_a_lone_config_is_refused_changing_nothing() -> None:
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=0.5)])
    handle = spec.apply(model)
    try:
        with pytest.raises(IsolationTypeError) as error:
            handle.attach(opt, {"scheduler": sched, "interval": "step"})
        assert str(error.value) == (
            "IsolationSpec.attach(): schedulers must be an LR scheduler or a list of them, got "
            "dict; pass each scheduler itself (a Lightning config's 'scheduler', not the config)"
        )
        assert groups_of(opt) == [[id(model.head.weight), id(model.head.bias)]]
        handle.attach(opt, sched)
        assert handle.step(epoch=1, step=1) == ["trunk.3"]
        assert sched.base_lrs == [0.1, 0.5]
    finally:
        handle.restore()


def test_without_a_thaw_group_schedulers_are_not_read() -> None:
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    handle = IsolationSpec(freeze=["trunk"]).apply(model)
    try:
        handle.attach(opt, [None])  # nothing would ever join a schedule
        assert groups_of(opt) == [[id(model.head.weight), id(model.head.bias)]]
    finally:
        handle.restore()


def test_a_second_attach_adds_only_the_schedulers_it_did_not_have_and_each_extends_once() -> None:
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    first = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    second = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=0.5)])
    handle = spec.apply(model, optimizer=opt)
    try:
        handle.attach(opt, [first])
        handle.attach(opt, [first, second])
        assert handle.step(epoch=1, step=1) == ["trunk.3"]
        assert first.base_lrs == [0.1, 0.5] and second.base_lrs == [0.1, 0.5]
    finally:
        handle.restore()
    assert first.base_lrs == [0.1] and second.base_lrs == [0.1]


def test_a_refused_load_takes_the_warmup_of_the_groups_it_thawed_off_the_optimizer() -> None:
    spec = IsolationSpec(
        freeze=["trunk"],
        thaw=[Thaw("trunk.3", epoch=1, lr=0.5, warmup_ratio=0.5, warmup_steps=2)],
    )
    earlier = spec.apply(Net(), optimizer=torch.optim.SGD(Net().head.parameters(), lr=0.1))
    earlier.step(epoch=1, step=1)
    saved = earlier.state_dict()
    earlier.restore()
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    handle = spec.apply(model, optimizer=opt)
    try:
        hooks = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
        with pytest.raises(CheckpointMismatchError, match=r"it is inconsistent"):
            handle.load_state_dict({**saved, "frozen": ["trunk.0.weight"]})
        assert handle.thawed == () and len(opt.param_groups) == 1
        assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == hooks
        handle.step(epoch=0, step=0)
        model(torch.randn(4, 4))[0].sum().backward()
        opt.step()  # the warmup of a group the load took back no longer looks for it
    finally:
        handle.restore()


class _Wrapped:
    """An optimizer wrapper as Lightning and Fabric hand them out: the optimizer in
    ``.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


@pytest.mark.parametrize(
    "pick", ["index 0", "index 1", "object 0", "wrapped 1"], ids=lambda p: p.replace(" ", "-")
)
def test_thaw_takes_its_optimizer_by_index_by_object_or_through_a_wrapper(pick: str) -> None:
    model = Net()
    opts = [
        torch.optim.SGD(model.head.parameters(), lr=0.1),
        torch.optim.SGD(model.aux.parameters(), lr=0.2),
    ]
    how, index = pick.split()
    chosen = {"index": int(index), "object": opts[int(index)], "wrapped": _Wrapped(opts[1])}[how]
    thaw = Thaw("trunk.3", epoch=1, lr=0.5, optimizer_idx=1 - int(index))  # not the one chosen
    handle = IsolationSpec(freeze=["trunk"], thaw=[thaw]).apply(model, optimizer=opts)
    try:
        group = handle.thaw("trunk.3", optimizer=chosen)
        assert group is opts[int(index)].param_groups[-1]
        assert [len(o.param_groups) for o in opts] == ([2, 1] if index == "0" else [1, 2])
    finally:
        handle.restore()


@pytest.mark.parametrize("chosen", [2, -1, "stranger"])
def test_thaw_refuses_an_optimizer_index_out_of_range_or_one_not_attached(chosen: object) -> None:
    model = Net()
    opts = [
        torch.optim.SGD(model.head.parameters(), lr=0.1),
        torch.optim.SGD(model.aux.parameters(), lr=0.2),
    ]
    if chosen == "stranger":
        chosen = torch.optim.SGD(model.trunk[0].parameters(), lr=0.3)
    thaw = Thaw("trunk.3", epoch=1, lr=0.5, optimizer_idx=0)
    handle = IsolationSpec(freeze=["trunk.3"], thaw=[thaw]).apply(model, optimizer=opts)
    try:
        with pytest.raises(SpecError, match=r"not one of the 2 attached optimizers"):
            handle.thaw("trunk.3", optimizer=chosen)
        assert [len(o.param_groups) for o in opts] == [1, 1] and handle.thawed == ()
    finally:
        handle.restore()


def test_an_lr_given_at_the_thaw_is_the_base_lr_its_schedulers_start_from() -> None:
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=0.5)])
    handle = spec.apply(model, optimizer=opt)
    handle.attach(opt, [sched])
    try:
        handle.step(epoch=0, step=0)
        model(torch.randn(4, 4))[0].sum().backward()
        opt.step()
        sched.step()  # the schedule is at half its base lr
        group = handle.thaw("trunk.3", lr=0.01)
        assert group["initial_lr"] == 0.01 and sched.base_lrs == [0.1, 0.01]
        assert group["lr"] == pytest.approx(0.005)
    finally:
        handle.restore()


def test_a_group_thawed_into_another_optimizer_aligns_with_that_optimizers_first_group() -> None:
    model = Net()
    home = torch.optim.SGD(
        [
            {"params": list(model.head.parameters())},
            {"params": list(model.trunk[3].parameters()), "lr": 0.3},
        ],
        lr=0.1,
    )
    other = torch.optim.SGD(model.aux.parameters(), lr=0.2)
    spec = IsolationSpec(freeze=["trunk.3"], thaw=[Thaw("trunk.3", epoch=1, align=True)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = spec.apply(model, optimizer=[home, other])
    try:
        handle.step(epoch=0, step=0)
        handle.thaw("trunk.3", optimizer=other)
        used: list[float] = []
        other.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[1]["lr"]))
        model(torch.randn(4, 4))[0].sum().backward()
        other.step()
        assert used == [0.2]  # other's group 0, not group 1 of the optimizer it came from
    finally:
        handle.restore()


_NO_HOME = (
    "IsolationSpec: thaw group 'trunk.3': its parameters ['trunk.3.weight', 'trunk.3.bias'] are "
    "in no optimizer and there are {n} optimizers, so once thawed they would be in no optimizer "
    "(never learn); set optimizer_idx= in the thaw step"
)


@pytest.mark.parametrize(
    ("homes", "optimizer_idx", "message"),
    [
        (
            [[], []],
            2,
            "IsolationSpec: thaw group 'trunk.3': optimizer_idx=2 but there are 2 optimizer(s); "
            "its parameters ['trunk.3.weight', 'trunk.3.bias'] would be in no optimizer once "
            "thawed",
        ),
        (
            [["trunk.3.weight"], ["trunk.3.bias"]],
            None,
            "IsolationSpec: thaw group 'trunk.3': its parameters sit in optimizers [0, 1]; say "
            "which one receives them with optimizer_idx=",
        ),
        ([[], []], None, _NO_HOME.format(n=2)),
        ([], None, _NO_HOME.format(n=0) + ", and pass the optimizer"),
    ],
    ids=["index-past-the-last", "two-homes", "no-home-among-two", "no-optimizer"],
)
def test_a_thaw_group_without_one_optimizer_to_join_is_refused_at_attach(
    homes: list[list[str]], optimizer_idx: int | None, message: str
) -> None:
    model = Net()
    params = dict(model.named_parameters())
    opts = [
        torch.optim.SGD([*model.head.parameters(), *(params[n] for n in names)], lr=0.1)
        for names in homes
    ]
    thaw = Thaw("trunk.3", epoch=1, lr=0.5, optimizer_idx=optimizer_idx)
    handle = IsolationSpec(freeze=["trunk"], thaw=[thaw]).apply(model)
    try:
        with pytest.raises(SpecError) as caught:
            handle.attach(opts)
        assert str(caught.value) == message
    finally:
        handle.restore()


@pytest.mark.parametrize("idx", [0, 1], ids=["first", "second"])
def test_a_thaw_group_joins_the_one_optimizer_its_parameters_came_from(idx: int) -> None:
    model = Net()
    opts = [torch.optim.SGD(model.head.parameters(), lr=0.1)]
    opts.insert(idx, torch.optim.SGD([*model.aux.parameters(), *model.trunk[3].parameters()]))
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=0.5)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = spec.apply(model, optimizer=opts)
    try:
        handle.step(epoch=1, step=1)
        assert groups_of(opts[idx])[-1] == [id(model.trunk[3].weight), id(model.trunk[3].bias)]
        assert [len(o.param_groups) for o in opts] == ([2, 1] if idx == 0 else [1, 2])
    finally:
        handle.restore()


def _two_groups(model: Net, second: list[torch.nn.Parameter]) -> torch.optim.SGD:
    """Group 0: the head, with the defaults; group 1: ``second``, with settings of its own."""
    return torch.optim.SGD(
        [
            {"params": list(model.head.parameters())},
            {"params": second, "lr": 0.3, "momentum": 0.9, "nesterov": True},
        ],
        lr=0.1,
    )


def _settings(group: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in group.items() if k != "params"}


@pytest.mark.parametrize(
    ("lr", "align", "second", "settings_of"),
    [
        (None, False, ["trunk.3.weight", "trunk.3.bias"], 1),
        (0.5, False, ["trunk.3.weight", "trunk.3.bias"], 1),
        (None, True, ["trunk.3.weight", "trunk.3.bias"], 1),
        (None, True, ["aux.weight"], 0),
    ],
    ids=["from-its-group", "from-its-group-with-lr", "aligned-with-its-group", "aligned-no-group"],
)
def test_a_thawed_group_takes_exactly_the_settings_of_the_group_it_came_from(
    lr: float | None, align: bool, second: list[str], settings_of: int
) -> None:
    model = Net()
    params = dict(model.named_parameters())
    opt = _two_groups(model, [params[n] for n in second])
    expected = _settings(opt.param_groups[settings_of]) | ({} if lr is None else {"lr": lr})
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=lr, align=align)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = spec.apply(model, optimizer=opt)
    try:
        handle.step(epoch=1, step=1)
        assert groups_of(opt)[-1] == [id(model.trunk[3].weight), id(model.trunk[3].bias)]
        assert _settings(opt.param_groups[-1]) == expected
    finally:
        handle.restore()


@pytest.mark.parametrize(
    ("second", "extra", "detail"),
    [
        (["trunk.3.weight"], [], "its parameters ['trunk.3.bias'] are in no optimizer group"),
        (
            ["trunk.3.weight"],
            ["trunk.3.bias"],
            "its parameters come from param groups [0, 1] of optimizer 0",
        ),
    ],
    ids=["partly-in-no-group", "from-two-groups"],
)
def test_a_thaw_without_lr_whose_parameters_have_no_one_group_is_refused(
    second: list[str], extra: list[str], detail: str
) -> None:
    model = Net()
    params = dict(model.named_parameters())
    opt = _two_groups(model, [params[n] for n in second])
    opt.param_groups[0]["params"] += [params[n] for n in extra]
    handle = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1)]).apply(model)
    try:
        with pytest.raises(SpecError) as caught:
            handle.attach(opt)
        assert str(caught.value) == (
            f"IsolationSpec: thaw group 'trunk.3': lr is not set and {detail}, so there are no "
            "settings to give them once thawed; set lr= in the thaw step, or put them in one "
            "param group when building the optimizer (the spec takes them out while frozen)"
        )
    finally:
        handle.restore()


def test_restore_takes_every_thawed_group_out_of_the_schedulers_too() -> None:
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    thaws = [Thaw("trunk.3", epoch=1, lr=0.5), Thaw("trunk.0", epoch=1, lr=0.2)]
    handle = IsolationSpec(freeze=["trunk"], thaw=thaws).apply(model)
    handle.attach(opt, [sched])
    handle.step(epoch=1, step=1)
    assert sched.base_lrs == [0.1, 0.5, 0.2]
    handle.restore()
    assert len(opt.param_groups) == 1
    assert sched.base_lrs == [0.1] and sched.get_last_lr() == [0.1]


def test_a_group_thawed_by_a_load_before_attach_warms_up_from_where_it_was_thawed() -> None:
    spec = IsolationSpec(
        freeze=["trunk"],
        thaw=[Thaw("trunk.3", epoch=1, lr=0.5, warmup_ratio=0.5, warmup_steps=2)],
    )
    earlier = spec.apply(Net(), optimizer=torch.optim.SGD(Net().head.parameters(), lr=0.1))
    earlier.step(epoch=1, step=4)  # thawed at global step 4
    saved = earlier.state_dict()
    earlier.restore()
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    handle = spec.apply(model)
    handle.load_state_dict(saved)
    handle.attach(opt)  # the thawed group joins now, with its warm-up from step 4
    try:
        used: list[float] = []
        opt.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[1]["lr"]))
        handle.step(epoch=1, step=5)
        model(torch.randn(4, 4))[0].sum().backward()
        opt.step()
        assert used == [pytest.approx(0.375)]  # one of two warm-up steps: 0.5 * 0.75
    finally:
        handle.restore()


def test_frozen_parameters_refused_in_an_optimizer_are_named_eight_at_most_with_the_fix() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(5)))
    opt = torch.optim.SparseAdam(model.parameters())
    spec = IsolationSpec(freeze=["0", "1", "2", "3", "4"], frozen_in_optimizer="error")
    with pytest.raises(SpecError) as caught:
        spec.apply(model, optimizer=opt)
    lines = [
        f"  {n}: optimizer 0, param group 0 (no weight decay or optimizer state moves it now)"
        for n, _ in list(model.named_parameters())[:8]
    ]
    assert str(caught.value) == (
        "IsolationSpec: 10 frozen parameters sit in an optimizer, where a zero gradient with "
        "weight decay or momentum can still move them:\n"
        + "\n".join(lines)
        + "\nFix: build the optimizer from trainable parameters only ([p for p in "
        "model.parameters() if p.requires_grad]), or let the spec take them out with "
        "frozen_in_optimizer='remove'"
    )
    assert all(p.requires_grad for p in model.parameters())


def test_an_optimizer_that_holds_state_for_frozen_parameters_is_refused_by_their_names() -> None:
    model = Net()
    opt = torch.optim.SGD([*model.trunk[3].parameters(), *model.head.parameters()], momentum=0.9)
    model(torch.randn(4, 4))[0].sum().backward()
    opt.step()
    with pytest.raises(SpecError) as caught:
        IsolationSpec(freeze=["trunk"]).apply(model, optimizer=opt)
    assert str(caught.value) == (
        "IsolationSpec: the optimizer already holds state for frozen parameters "
        "['trunk.3.weight', 'trunk.3.bias']; apply the spec before the first optimizer step "
        "(or build the optimizer after applying it)"
    )


def test_a_group_a_load_thawed_is_no_frozen_parameter_in_the_optimizer_attached_after() -> None:
    spec = IsolationSpec(
        freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=0.5)], frozen_in_optimizer="error"
    )
    earlier = spec.apply(Net(), optimizer=torch.optim.SGD(Net().head.parameters(), lr=0.1))
    earlier.step(epoch=1, step=1)
    saved = earlier.state_dict()
    earlier.restore()
    model = Net()
    opt = torch.optim.SGD([*model.head.parameters(), *model.trunk[3].parameters()], lr=0.1)
    handle = spec.apply(model)
    handle.load_state_dict(saved)
    try:
        handle.attach(opt)  # trunk.3 is thawed: it is moved to a group of its own, not refused
        assert groups_of(opt) == [
            [id(model.head.weight), id(model.head.bias)],
            [id(model.trunk[3].weight), id(model.trunk[3].bias)],
        ]
    finally:
        handle.restore()


@pytest.mark.parametrize("thaw", [True, False], ids=["frozen-and-thawed", "frozen-only"])
def test_an_optimizer_that_steps_without_gradients_is_refused_with_what_it_holds(
    thaw: bool,
) -> None:
    model = Net()
    sgd = torch.optim.SGD(model.head.parameters(), lr=0.1)
    lbfgs = torch.optim.LBFGS([*model.aux.parameters(), *model.trunk[3].parameters()])
    thaws = [Thaw("trunk.3", epoch=1, lr=0.5)] if thaw else []
    with pytest.raises(SpecError) as caught:
        IsolationSpec(freeze=["trunk.3"], thaw=thaws).apply(model, optimizer=[sgd, lbfgs])
    assert str(caught.value) == (
        "IsolationSpec: optimizer 1 (LBFGS) steps every parameter it was built with along one "
        "flat search direction, in one param group: frozen parameters cannot be taken out of it "
        f"(['trunk.3.weight', 'trunk.3.bias']) nor thawed groups added "
        f"({['trunk.3'] if thaw else []}). Build it after apply from the trainable parameters "
        "only, and leave thaws out of a spec it trains"
    )


def test_a_group_thawed_without_lr_joins_its_source_groups_schedule_where_it_stands() -> None:
    model = Net()
    opt = _two_groups(model, list(model.trunk[3].parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 0.5**e, lambda e: 0.1**e])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a schedule that moved before the spec was attached
        sched.step()  # group 1 (trunk.3's own) is at a tenth of its base lr 0.3
    handle = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1)]).apply(model)
    handle.attach(opt, [sched])
    try:
        handle.step(epoch=1, step=1)
        thawed = opt.param_groups[-1]
        assert thawed["initial_lr"] == 0.3 and thawed["lr"] == pytest.approx(0.03)
        assert sched.base_lrs == [0.1, 0.3, 0.3]
        model(torch.randn(4, 4))[0].sum().backward()
        opt.step()
        sched.step()
        assert thawed["lr"] == pytest.approx(0.003)  # group 1's lambda, not group 0's
    finally:
        handle.restore()


def test_an_aligned_group_follows_the_lr_of_the_group_it_came_from_at_each_step() -> None:
    model = Net()
    opt = _two_groups(model, list(model.trunk[3].parameters()))
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, align=True)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = spec.apply(model, optimizer=opt)
    try:
        handle.step(epoch=1, step=1)
        opt.param_groups[1]["lr"] = 0.25  # as a scheduler of group 1 would
        used: list[float] = []
        opt.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[-1]["lr"]))
        model(torch.randn(4, 4))[0].sum().backward()
        opt.step()
        assert used == [0.25]
    finally:
        handle.restore()


def test_an_optimizer_that_is_not_one_is_refused_by_its_type() -> None:
    model = Net()
    opts = [torch.optim.SGD(model.head.parameters()), "sgd"]
    with pytest.raises(IsolationTypeError) as caught:
        IsolationSpec(freeze=["trunk"]).apply(model, optimizer=opts)
    assert str(caught.value) == (
        "IsolationSpec: optimizer must be a torch.optim.Optimizer (or a list of them), got str"
    )
