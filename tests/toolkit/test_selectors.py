"""The one selector grammar: '!' exclusions and 'type:<Class>' selection, the same in freeze,
the spec (freeze, thaw, protect), the audits and gradient_report; typos are errors."""

from __future__ import annotations

import re
from collections import OrderedDict

import pytest
import torch
from pytorch_lightning.callbacks import BaseFinetuning
from torch import nn

from isolate import IsolationSpec, Thaw, assert_isolated, freeze, gradient_report
from isolate._selectors import select, select_names
from isolate.errors import GradientLeakError, SelectorError, SpecError
from isolate.freezing import held_in_eval


class Block(nn.Module):
    """A conv block whose parent holds a parameter of its own (Lightning's ConvBlockParam)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3)
        self.parent_param = nn.Parameter(torch.zeros(1))
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + self.parent_param


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(Block(3, 4), nn.GroupNorm(2, 4), Block(4, 4), nn.LayerNorm(4))
        self.head = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.backbone[2](self.backbone[1](self.backbone[0](x)))
        return self.head(self.backbone[3](x.mean((2, 3))))


def names(model: nn.Module, *selectors: str) -> list[str]:
    return list(select(model, selectors, "test").params)


def flags(model: nn.Module) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in model.named_parameters()}


BACKBONE_NORMS = [
    "backbone.0.bn.weight",
    "backbone.0.bn.bias",
    "backbone.1.weight",
    "backbone.1.bias",
    "backbone.2.bn.weight",
    "backbone.2.bn.bias",
    "backbone.3.weight",
    "backbone.3.bias",
]


def test_type_selects_by_class_or_base_class_glob_and_scope() -> None:
    net = Net()
    bns = ["backbone.0.bn.weight", "backbone.0.bn.bias", "backbone.2.bn.weight"]
    bns += ["backbone.2.bn.bias", "head.1.weight", "head.1.bias"]
    assert names(net, "type:BatchNorm2d|BatchNorm1d") == bns
    assert names(net, "type:_BatchNorm") == bns  # a base class
    assert names(net, "type:_NormBase") == bns
    assert names(net, "backbone/type:*Norm*") == BACKBONE_NORMS
    assert names(net, "head/type:Linear") == [
        f"head.{i}.{k}" for i in (0, 2) for k in ("weight", "bias")
    ]
    assert names(net, "head.0/type:Linear") == ["head.0.weight", "head.0.bias"]  # scope itself
    # A type matched by a parent takes everything below it, the parent's own parameter too.
    assert names(net, "backbone/type:Block")[:3] == [
        "backbone.0.parent_param",
        "backbone.0.conv.weight",
        "backbone.0.conv.bias",
    ]


def test_exclusion_takes_out_of_the_rest_and_alone_starts_from_everything() -> None:
    net = Net()
    every = [n for n, _ in net.named_parameters()]
    kept = names(net, "backbone", "!backbone/type:*Norm*")
    assert kept == [
        "backbone.0.parent_param",
        "backbone.0.conv.weight",
        "backbone.0.conv.bias",
        "backbone.2.parent_param",
        "backbone.2.conv.weight",
        "backbone.2.conv.bias",
    ]
    assert names(net, "backbone", "!type:*Norm*") == kept  # '!' applies to the selection
    assert names(net, "!head") == [n for n in every if n.startswith("backbone")]
    assert names(net, "*", "!*.bias", "!*parent_param") == [
        n for n in every if not n.endswith(("bias", "parent_param"))
    ]


@pytest.mark.parametrize(
    ("selectors", "message"),
    [
        (
            ("backbone", "!head"),
            r"^test: the exclusion '!head' takes nothing out of \['backbone'\]",
        ),
        (("backbone", "!bakbone"), r"^test: 'bakbone' matched no parameter"),
        (("type:BatchNorm3d",), r"^test: 'type:BatchNorm3d' matched no module of Net; its module "),
        (("nope/type:Linear",), r"^test: 'nope/type:Linear': 'nope' is not a submodule"),
        (("type:",), r"^test: 'type:': a type selector is 'type:<Class>'"),
        (("type:Batch Norm",), r"a type selector is"),
        (("head", "!!head"), r"^test: '!!head' is not an exclusion"),
        (("head", "!head"), r"^test: the exclusions \['!head'\] take out everything"),
    ],
)
def test_mistakes_are_errors_naming_the_selector(selectors: tuple[str, ...], message: str) -> None:
    with pytest.raises(SelectorError, match=message):
        select(Net(), selectors, "test")


def test_freeze_backbone_but_norms_is_one_line_like_train_bn() -> None:
    """BaseFinetuning.freeze(train_bn=True) on a twin gives the same flags; BatchNorm left out
    of the selection is neither frozen nor held, and restore is exact."""
    ours, theirs = Net(), Net()
    BaseFinetuning.freeze(theirs.backbone, train_bn=True)
    handle = freeze(ours, "backbone", "!type:_BatchNorm")
    assert flags(ours) == flags(theirs)
    assert all(m.training for m in ours.backbone.modules())
    handle.restore()
    assert all(flags(ours).values())
    # train_bn=False is the plain freeze, and BatchNorm is held in eval mode.
    BaseFinetuning.make_trainable(theirs)
    BaseFinetuning.freeze(theirs.backbone, train_bn=False)
    with isolate_frozen(ours, "backbone"):
        assert flags(ours) == flags(theirs)
        ours.train()
        stats = ours.backbone[0].bn.running_mean.clone()
        ours(torch.randn(2, 3, 12, 12))
        assert torch.equal(ours.backbone[0].bn.running_mean, stats)  # held in eval mode


def isolate_frozen(model: nn.Module, *selectors: str):  # type: ignore[no-untyped-def]
    from isolate import frozen

    return frozen(model, *selectors)


def test_complex_nested_model_counts_like_lightning() -> None:
    """Lightning's test_complex_nested_model: parents with own parameters are frozen, the
    encoder's norms are not, and the encoder holds 9 parameters."""
    model = nn.Sequential(
        OrderedDict(
            [("encoder", nn.Sequential(Block(3, 64), Block(64, 128))), ("decoder", Block(128, 10))]
        )
    )
    with isolate_frozen(model, "encoder", "!type:_BatchNorm"):
        assert not model.encoder[0].conv.weight.requires_grad
        assert not model.encoder[0].parent_param.requires_grad
        assert model.encoder[0].bn.weight.requires_grad
    theirs = list(BaseFinetuning.filter_params(model.encoder, train_bn=True))
    assert [id(p) for p in select(model, ("encoder",), "test").params.values()] == [
        id(p) for p in model.encoder.parameters()
    ]
    assert len(names(model, "encoder")) == len(theirs) == 10  # conv, bn, parent: 5 per block


def test_spec_thaw_of_backbone_takes_its_frozen_part() -> None:
    net = Net()
    opt = torch.optim.SGD(
        [p for n, p in net.named_parameters() if not n.startswith("backbone")], lr=0.1
    )
    spec = IsolationSpec(
        freeze=["backbone", "!type:*Norm*"],
        thaw=[Thaw("backbone", epoch=1, lr=0.01)],
    )
    with spec.applied(net, opt) as handle:
        group = handle.plan.group("backbone")
        assert list(group.params) == [n for n in names(net, "backbone") if n not in BACKBONE_NORMS]
        assert all(net.get_parameter(n).requires_grad for n in BACKBONE_NORMS)
        handle.step(epoch=1, step=0)
        assert [len(g["params"]) for g in opt.param_groups] == [6, 6]
        assert all(p.requires_grad for p in net.parameters())


def test_thaw_of_only_trainable_parameters_is_still_refused_saying_what_to_do() -> None:
    spec = IsolationSpec(freeze=["backbone"], thaw=[Thaw(["backbone", "head.0"], epoch=1)])
    net = Net()
    before = flags(net)
    with pytest.raises(
        SpecError, match=r"'head.0' selects 2 parameters that freeze does not freeze"
    ) as e:
        spec.apply(net)
    assert "trainable already" in str(e.value) and "add them to freeze" in str(e.value)
    assert "drop 'head.0' from the thaw's select" in str(e.value)
    assert flags(net) == before


def test_protect_and_audits_resolve_selectors_together() -> None:
    net = Net()
    x = torch.randn(2, 3, 12, 12)
    head_only = net.head(net.backbone[3](torch.randn(2, 4)))  # reaches head and backbone.3
    loss = head_only.sum()
    assert_isolated(loss, ["backbone", "!backbone.3"], model=net)  # the LayerNorm is excluded
    with pytest.raises(GradientLeakError, match=r"backbone\.3\.weight"):
        assert_isolated(loss, ["backbone"], model=net)
    report = gradient_report(
        {"main": net(x).sum()}, net, groups={"norms": ["type:*Norm*", "!head"]}
    )
    assert list(report["norms"].parameters) == BACKBONE_NORMS
    spec = IsolationSpec(protect={"aux": ["backbone", "!type:*Norm*"]})
    with spec.applied(net) as handle:
        assert handle.plan.protect is not None
        assert "backbone.1.weight" not in handle.plan.protect["aux"]
        assert "backbone.0.conv.weight" in handle.plan.protect["aux"]


def test_norms_without_parameters_under_every_module_selector_are_held() -> None:
    def block() -> nn.Sequential:
        return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False))

    model = nn.ModuleDict({"a": block(), "b": block()})
    handle = freeze(model, model["a"], model["b"], bn="eval")
    assert held_in_eval(model) == ("a.1", "b.1")
    handle.restore()


def test_a_glob_over_the_buffers_of_a_norm_that_is_the_model_covers_it() -> None:
    norm = nn.BatchNorm1d(2)
    handle = freeze(norm, "[wr]*", bn="eval")  # the weight, and the running_* buffers' names
    assert held_in_eval(norm) == ("",)
    handle.restore()


def test_a_type_selector_that_matches_nothing_lists_every_module_type_of_the_model() -> None:
    types = "['BatchNorm1d', 'BatchNorm2d', 'Block', 'Conv2d', 'GroupNorm', 'LayerNorm', "
    types += "'Linear', 'Net', 'Sequential']"
    with pytest.raises(SelectorError) as e:
        select(Net(), ("type:Dropout",), "test")
    assert str(e.value) == (
        f"test: 'type:Dropout' matched no module of Net; its module types are {types} "
        f"(a name matches the class or any base class)"
    )
    with pytest.raises(SelectorError) as e:
        select(Net(), ("head/type:Conv2d",), "test")
    assert str(e.value) == (
        f"test: 'head/type:Conv2d' matched no module under 'head' of Net; its module types "
        f"are {types} (a name matches the class or any base class)"
    )


def test_a_scope_whose_name_holds_type_is_read_up_to_the_last_type() -> None:
    model = nn.ModuleDict({"type:a": nn.Sequential(nn.Linear(2, 2)), "b": nn.Linear(2, 2)})
    assert names(model, "type:a/type:Linear") == ["type:a.0.weight", "type:a.0.bias"]


class Pair(nn.Module):
    """Two blocks, each a Linear and a BatchNorm without parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False))
        self.b = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False))


def test_each_type_selector_covers_the_norms_without_parameters_below_what_it_matches() -> None:
    model = Pair()
    assert list(select(model, ("a/type:Sequential",), "test").norms) == ["a.1"]
    both = select(model, ("a/type:Sequential", "b/type:Sequential"), "test")
    assert list(both.norms) == ["a.1", "b.1"]
    assert list(select(model, (model.a, "b/type:Sequential"), "test").norms) == ["a.1", "b.1"]


def test_a_norm_whose_parameters_are_all_selected_is_covered_however_they_were_named() -> None:
    net = Net()
    picked = select(net, ("head.1.weight", "head.1.bias"), "test")
    assert list(picked.norms) == ["head.1"]
    by_object = select(net, (net.head[1].weight, net.head[1].bias), "test")
    assert list(by_object.norms) == ["head.1"]
    assert select(net, ("head.1.weight",), "test").norms == {}  # one of two is not enough


def test_a_norm_registered_twice_is_covered_once_under_its_first_name() -> None:
    model = Pair()
    model.again = model.a[1]
    assert list(select(model, (), "test").norms) == ["a.1", "b.1"]  # not "again" too


def test_a_glob_covers_a_norm_without_parameters_by_the_full_names_of_its_buffers() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False))
    picked = select(model, ("[01].*",), "test")
    assert list(picked.params) == ["0.weight", "0.bias"]
    assert list(picked.norms) == ["1"]


class Shallow(nn.Module):
    """A parameter and a BatchNorm without buffers, each named by one letter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.n = nn.BatchNorm1d(2, track_running_stats=False)


def test_a_glob_over_the_name_of_a_norm_with_parameters_does_not_cover_it() -> None:
    picked = select(Shallow(), ("?",), "test")  # "w" and the name "n", not "n.weight"
    assert list(picked.params) == ["w"]
    assert picked.norms == {}


def test_selectors_are_read_by_their_kind_never_as_module_names() -> None:
    """A type selector or a glob that is also the name of a module (a ModuleDict key) picks
    by its kind; the module of that name is not covered for it."""
    model = nn.ModuleDict({"type:Linear": nn.BatchNorm1d(2, affine=False), "fc": nn.Linear(2, 2)})
    assert select(model, ("type:Linear",), "test").norms == {}
    odd = nn.Module()
    odd.wx = nn.Parameter(torch.ones(2))
    odd.add_module("w?", nn.BatchNorm1d(2, affine=False))
    picked = select(odd, ("w?",), "test")  # "wx", and no buffer name of "w?"
    assert list(picked.params) == ["wx"]
    assert picked.norms == {}


KEYS = [
    "trunk.0.weight",
    "trunk.0.bias",
    "trunk.1.running_mean",
    "head.weight",
    "head.bias",
    "head.scale",
]
TRUNK = KEYS[:3]


def test_names_are_picked_by_prefix_glob_and_exclusion_without_a_model() -> None:
    assert select_names(KEYS, ["trunk", "*.bias"], "doc") == [*TRUNK, "head.bias"]
    assert select_names(KEYS, ["!head"], "doc") == TRUNK  # exclusions alone: from every name
    assert select_names(KEYS, [], "doc") == []  # no selector: no name (no buffer, no key ignored)
    assert select_names(KEYS, ["trunk", "!*.bias"], "doc") == [KEYS[0], KEYS[2]]
    # Exclusions are each checked against what is picked, in any order, as select does:
    # a redundant one (inside another) is no error.
    for selectors in (["!head", "!head.weight"], ["!head.weight", "!head"]):
        assert select_names(KEYS, selectors, "doc") == TRUNK
    # Without each_must_match a selector or an exclusion that picks nothing is no error.
    loose = select_names(KEYS, ["trunk", "nothing", "!head"], "doc", each_must_match=False)
    assert loose == TRUNK


@pytest.mark.parametrize(
    ("selectors", "message"),
    [
        ([3], "doc: selectors of names must be non-empty strings, got 3"),
        ([""], "doc: selectors of names must be non-empty strings, got ''"),
        (
            ["type:Linear"],
            "doc: 'type:Linear' selects by module class, which the names do not tell (there "
            "is no model); select by name or glob instead ('trunk', '*.norm.*')",
        ),
        (
            ["trunk.[0"],
            "doc: malformed glob 'trunk.[0': unbalanced '[' / ']'; escape a literal '[' as "
            "'[[]' and a literal ']' as '[]]', or remove it",
        ),
        (
            ["!!head"],
            "doc: '!!head' is not an exclusion; write '!' once, followed by a module name, a "
            "glob or a type selector ('!head', '!type:BatchNorm2d')",
        ),
        (
            ["trunk", "!head.weight"],
            "doc: the exclusion '!head.weight' takes nothing out of ['trunk'] in the names; "
            "remove it, or fix the name",
        ),
        (
            ["head.wieght"],
            "doc: 'head.wieght' matched none of the names; "
            "closest: ['head.weight', 'head.bias', 'head.scale']",
        ),
        (
            ["xyzzy"],
            "doc: 'xyzzy' matched none of the names; they start ['head.bias', 'head.scale', "
            "'head.weight', 'trunk.0.bias', 'trunk.0.weight']",
        ),
    ],
    ids=["no-string", "empty", "type", "glob", "bangs", "nothing-out", "closest", "no-close"],
)
def test_a_bad_selector_of_names_is_refused_word_for_word(
    selectors: list[object], message: str
) -> None:
    with pytest.raises(SelectorError) as e:
        select_names(KEYS, selectors, "doc")  # type: ignore[arg-type]
    assert str(e.value) == message


class Gate(nn.Module):
    """A block whose own forward reads ``.training``, around a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if self.training else x


def test_exclusions_take_the_layers_they_cover_out_of_the_norms_and_the_modes() -> None:
    model = Pair()
    assert list(select(model, ("!b",), "test").norms) == ["a.1"]  # b.1 has no parameter
    net = Net()
    assert list(select(net, ("head", "!head.1.weight"), "test").norms) == []  # half of head.1
    held = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Dropout()), Gate())
    picked = select(held, ("!1",), "test", modes=True)
    assert list(picked.modes) == ["2"]  # the dropout is excluded, the gate is not
    # The gate holds no parameter of its own: excluding its Linear leaves it covered.
    assert list(select(held, ("!2.fc",), "test", modes=True).modes) == ["1.1", "2"]
    assert select(held, ("!2.fc",), "test").modes == {}  # only with modes=True


def test_what_picks_nothing_is_refused_by_its_name_or_its_type() -> None:
    net = Net()
    with pytest.raises(SelectorError) as e:
        select(net, ("nope",), "test")
    assert str(e.value) == (
        "test: 'nope' matched no parameter of Net; its children are ['backbone', 'head']; a "
        "module name must name a submodule that has parameters"
    )

    def nothing(name: str, p: nn.Parameter) -> bool:
        return False

    with pytest.raises(SelectorError) as e:
        select(net, (nothing,), "test")
    assert str(e.value) == "test: 'nothing' matched no parameter of Net; its children are " + (
        "['backbone', 'head']"
    )
    model = Pair()
    with pytest.raises(SelectorError) as e:
        select(model, (model.a[1],), "test")
    assert str(e.value) == "test: 'BatchNorm1d' matched no parameter of Pair; its children " + (
        "are ['a', 'b']"
    )
    with pytest.raises(SelectorError) as e:
        select(model, (nn.Linear(2, 2),), "test")
    assert str(e.value) == (
        "test: the Linear passed as a selector is not a submodule of Pair; its children are "
        "['a', 'b']; pass one of its own modules or a name"
    )
    with pytest.raises(SelectorError, match=r"^test: the exclusions \['!head'\] take out"):
        select(net, ("head.*", "!head"), "test")  # a glob's picks are taken out too


def test_an_exclusion_that_takes_nothing_out_names_the_module_selectors_by_type() -> None:
    net = Net()
    with pytest.raises(SelectorError) as e:
        select(net, (net.head, "backbone.0", "!backbone.2"), "test")
    assert str(e.value) == (
        "test: the exclusion '!backbone.2' takes nothing out of ['Sequential', 'backbone.0'] "
        "(it picks only parameters that are not selected); remove it, or fix the name"
    )


def test_exclusions_that_take_out_everything_are_refused_naming_what_was_selected() -> None:
    net = Net()
    with pytest.raises(SelectorError) as e:
        select(net, ("!backbone", "!head"), "test")
    assert str(e.value) == (
        "test: the exclusions ['!backbone', '!head'] take out everything the whole model "
        "selects; nothing is left"
    )
    with pytest.raises(SelectorError) as e:
        select(net, (net.head, "!head"), "test")
    assert str(e.value) == (
        "test: the exclusions ['!head'] take out everything ['Sequential'] selects; nothing is left"
    )


def test_a_literal_bracket_is_escaped_as_the_error_says() -> None:
    keys = ["w[0]", "w[1]", "w!", "b"]
    assert select_names(keys, ["w[[]*"], "doc") == ["w[0]", "w[1]"]
    assert select_names(keys, ["*[]]"], "doc") == ["w[0]", "w[1]"]
    assert select_names(keys, ["w[!]]"], "doc") == ["w!"]  # a class of all but ']'
    assert select_names(keys, ["w[[]?[]]"], "doc") == ["w[0]", "w[1]"]
    for typo in ("w[0", "w*]", "w[!]", "w[]", "w[[]0]"):
        with pytest.raises(SelectorError, match=rf"^doc: malformed glob {re.escape(repr(typo))}"):
            select_names(keys, [typo], "doc")


def test_holders_are_the_modules_with_buffers_the_selection_covers_net_of_its_exclusions() -> None:
    table = nn.Module()  # no parameter: covered by its place alone
    table.register_buffer("pos", torch.arange(3.0))
    net = nn.Sequential(nn.Linear(2, 2), table, nn.BatchNorm1d(2), nn.Linear(2, 2))
    assert list(select(net, (), "t", holders=True).holders) == ["1", "2"]
    assert list(select(net, ("!2",), "t", holders=True).holders) == ["1"]
    assert list(select(net, ("0", "2"), "t", holders=True).holders) == ["2"]
    assert select(net, (), "t").holders == {}  # only when asked for
