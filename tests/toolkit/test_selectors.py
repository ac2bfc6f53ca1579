"""The one selector grammar: '!' exclusions and 'type:<Class>' selection, the same in freeze,
the spec (freeze, thaw, protect), the audits and gradient_report; typos are errors."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from pytorch_lightning.callbacks import BaseFinetuning
from torch import nn

from isolate import IsolationSpec, Thaw, assert_isolated, freeze, gradient_report
from isolate._selectors import select
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
