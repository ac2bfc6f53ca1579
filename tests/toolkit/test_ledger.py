"""The ledger: one row per parameter tensor, every column from the thing itself (a graph walk,
the optimizer's groups and state, the module's mode), and every contradiction flagged."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import isolate
from isolate.errors import (
    BlindSpotError,
    IsolationTypeError,
    SelectorError,
    ShardedGraphError,
)
from isolate.ledger import Ledger, ledger
from isolate.spec import IsolationSpec, Thaw
from tests.toolkit._shared import TanhOnce
from tests.toolkit.test_sharding import Net, _fully_shard


class LoRA(nn.Module):
    """A frozen base (an embedding and four linear layers) with rank-4 adapters on each layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(1537, 64)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(4, 64) * 0.1) for _ in range(4))
        self.up = nn.ParameterList(nn.Parameter(torch.randn(64, 4) * 0.1) for _ in range(4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer, down, up in zip(self.layers, self.down, self.up, strict=True):
            x = torch.relu(layer(x) + x @ down.T @ up.T)
        return x.mean()


def test_the_summary_line_of_a_lora_model() -> None:
    model = LoRA()
    model.embed.requires_grad_(False)
    model.layers.requires_grad_(False)
    opt = torch.optim.AdamW([*model.down, *model.up], lr=1e-3, weight_decay=0.0)
    book = ledger(model, model(torch.arange(8)), opt)
    assert str(book).splitlines()[-1] == (
        "trainable 2,048 of 117,056 parameters (1.75%) in 8 tensors; reached 8 of 8; irregular 0"
    )
    assert book.summary() == {
        "parameters": 117056,
        "trainable": 2048,
        "trainable_fraction": 2048 / 117056,
        "tensors": 17,
        "trainable_tensors": 8,
        "reached_tensors": 8,
        "irregular": 0,
    }
    json.dumps(book.to_dict())  # plain data for loggers
    header = str(book).splitlines()[0].split()
    assert header == [
        "name",
        "numel",
        "grad",
        "reached",
        "by",
        "optimizer",
        "lr",
        "wd",
        "momentum",
        "mode",
        "expects",
        "status",
    ]


def two_heads() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "trunk": nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1)),
            "head": nn.Linear(4, 2),
            "aux": nn.Linear(4, 1),
            "spare": nn.Linear(4, 1),
        }
    )


def losses(model: nn.ModuleDict) -> dict[str, torch.Tensor]:
    x = torch.randn(8, 4)
    features = model["trunk"](x)
    return {"main": model["head"](features).sum(), "aux": model["aux"](features.detach()).sum()}


def test_reach_comes_from_the_graph_and_agrees_with_autograd() -> None:
    model = two_heads()
    named = losses(model)
    book = ledger(model, named)
    params = dict(model.named_parameters())
    for row in book.rows:
        p = params[row.name]
        by_autograd = tuple(
            name
            for name, loss in named.items()
            if torch.autograd.grad(loss, p, retain_graph=True, allow_unused=True)[0] is not None
        )
        assert row.reached_by == by_autograd, row.name
    assert {r.name: r.reasons for r in book.irregular} == {
        "spare.weight": ("trainable but cut off: no loss reaches it",),
        "spare.bias": ("trainable but cut off: no loss reaches it",),
    }


def test_reach_through_a_once_differentiable_function_is_refused_not_read_as_cut_off() -> None:
    """Past the node a second derivative leaves, the graph's edges go to stand-in leaves:
    the layers behind it would read "trainable but cut off" while a real backward raises."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(2, 3, requires_grad=True)
    (g,) = torch.autograd.grad(model[1](TanhOnce.apply(model[0](x))).sum(), x, create_graph=True)
    with pytest.raises(BlindSpotError) as refused:
        ledger(model, {"penalty": g.pow(2).sum()})
    assert str(refused.value).startswith(
        "ledger(): the loss's graph runs through torch::autograd::Error (consumed by "
        "MmBackward0), whose backward raises"
    )


def test_every_contradiction_is_flagged_with_its_reason() -> None:
    model = two_heads()
    named = losses(model)
    model["head"].bias.requires_grad_(False)  # frozen after the forward: reached anyway
    model["trunk"][0].requires_grad_(False)
    decay = torch.optim.SGD(
        [
            {"params": model["trunk"].parameters(), "weight_decay": 0.1},
            {"params": [model["head"].weight]},
        ],
        lr=0.1,
    )
    other = torch.optim.SGD([model["head"].weight, *model["aux"].parameters()], lr=0.1)
    spec = {"trunk": "still", "head": "moves", "aux": "moves"}
    book = ledger(model, named, [decay, other], spec=spec)
    reasons = {r.name: r.reasons for r in book.rows}
    assert reasons["trunk.0.weight"] == (
        "frozen but in optimizer 0 group 0, where weight_decay=0.1 shrinks it on every step",
        "frozen but reached by main",  # frozen after the forward
    )
    assert reasons["head.weight"] == ("held by 2 optimizer groups",)
    assert reasons["head.bias"] == (
        "frozen but reached by main",
        "frozen but the spec expects it to move (moves)",
    )
    assert reasons["trunk.1.weight"] == ("trainable but the spec expects it still",)
    assert reasons["spare.weight"] == (
        "trainable but in no optimizer",
        "trainable but cut off: no loss reaches it",
        "trainable but not in the spec",
    )
    assert (
        book.rows[0].optimizer == 0 and book.rows[0].group == 0 and book.rows[0].weight_decay == 0.1
    )
    held = {r.name: (r.optimizer, r.group) for r in book.rows}
    assert held["head.weight"] == (0, 1) and held["aux.weight"] == (1, 0)  # its first holder
    text = book.format(limit=3)
    assert text.splitlines()[2].startswith("trunk.0.weight") and "... and" in text
    assert "irregular spare.weight: trainable but in no optimizer; " in text


def test_without_losses_the_reach_is_not_applicable() -> None:
    model = torch.nn.Linear(2, 1)
    book = ledger(model)
    assert [r.reached_by for r in book.rows] == [None, None]
    lines = book.format().splitlines()
    assert [line.split()[3] for line in lines[2:4]] == ["n/a", "n/a"]
    assert lines[-1].endswith("reached n/a (no losses) of 2; irregular 0")


def test_optimizer_state_and_modes_are_read_from_the_objects() -> None:
    model = two_heads()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = {r.name: r.momentum for r in ledger(model, optimizer=opt).rows}
    assert set(before.values()) == {False}
    sum(losses(model).values()).backward()
    opt.step()
    with isolate.frozen(model, "trunk", mode="eval"):
        model.train()
        rows = {r.name: r for r in ledger(model, optimizer=opt).rows}
    assert rows["trunk.1.weight"].mode == "eval (held)" and rows["trunk.0.weight"].mode == "train"
    assert rows["head.weight"].momentum is True and rows["head.weight"].lr == 0.05
    assert rows["spare.weight"].momentum is False  # never stepped: no gradient, no buffer
    assert rows["head.weight"].reached_by is None  # no losses given: reach not claimed


def test_a_spec_or_handle_says_what_it_expects() -> None:
    model = two_heads()
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.0", epoch=1, lr=0.1)])
    expects = {r.name: r.expects for r in ledger(model, spec=spec).rows}
    assert (
        expects["trunk.0.weight"] == "still until epoch 1" and expects["trunk.1.weight"] == "still"
    )
    assert expects["head.weight"] == "moves"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with spec.applied(model, opt) as handle:
        handle.step(epoch=1, step=3)
        now = {r.name: r for r in ledger(model, spec=handle, optimizer=opt).rows}
    assert now["trunk.0.weight"].expects == "moves" and now["trunk.1.weight"].expects == "still"
    assert not now["trunk.0.weight"].irregular and not now["trunk.1.weight"].irregular


def test_bad_arguments_are_refused() -> None:
    model = two_heads()
    with pytest.raises(IsolationTypeError, match=r"^ledger\(\): spec must be an isolate spec"):
        ledger(model, spec=3)
    with pytest.raises(SelectorError, match=r"spec\['head'\] = 'frozen' is not an expectation"):
        ledger(model, spec={"head": "frozen"})
    with pytest.raises(IsolationTypeError, match=r"^ledger\(\): losses must map names to tensors"):
        ledger(model, {"main": 1.0})  # type: ignore[dict-item]
    assert isinstance(ledger(model), Ledger) and "ledger" in isolate.__all__


def test_a_tied_parameter_is_one_row() -> None:
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    book = ledger(model, F.cross_entropy(model(torch.arange(4)), torch.arange(4)))
    assert [r.name for r in book.rows] == ["0.weight"] and book.rows[0].reached_by == ("loss",)


def _small() -> Ledger:
    """A frozen layer, and a trained one of which the optimizer holds only the weight."""
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([model[1].weight], lr=0.5, weight_decay=0.25, momentum=0.9)
    return ledger(model, {"main": model(torch.ones(1, 1)).sum()}, opt)


def test_the_ledger_as_data_keeps_every_field_of_every_row() -> None:
    def row(name, trains, reached, slot=None, reasons=(), status="frozen"):  # type: ignore[no-untyped-def]
        held = {"optimizer": 0, "group": 0, "lr": 0.5, "weight_decay": 0.25, "momentum": False}
        return {
            "name": name,
            "numel": 1,
            "requires_grad": trains,
            "reached_by": reached,
            **(held if slot else dict.fromkeys(held)),
            "mode": "train",
            "expects": None,
            "reasons": list(reasons),
            "status": status,
        }

    assert _small().to_dict() == {
        "rows": [
            row("0.weight", False, []),
            row("0.bias", False, []),
            row("1.weight", True, ["main"], slot=True, status="trains"),
            row(
                "1.bias",
                True,
                ["main"],
                reasons=["trainable but in no optimizer"],
                status="irregular",
            ),
        ],
        "losses": ["main"],
        "summary": {
            "parameters": 4,
            "trainable": 2,
            "trainable_fraction": 0.5,
            "tensors": 4,
            "trainable_tensors": 2,
            "reached_tensors": 2,
            "irregular": 1,
        },
    }
    unwalked = ledger(nn.Linear(1, 1)).to_dict()
    assert unwalked["losses"] is None and unwalked["rows"][0]["reached_by"] is None


def test_a_model_without_parameters_trains_no_fraction_of_them() -> None:
    assert ledger(nn.ReLU()).summary()["trainable_fraction"] == 0.0


def test_a_limited_table_puts_the_irregular_rows_first_only_when_it_cuts() -> None:
    book = _small()
    assert book.format(limit=4) == str(book)  # nothing cut: model order
    cut = book.format(limit=2).splitlines()
    assert [line.split()[0] for line in cut[2:5]] == ["1.bias", "0.weight", "..."]
    assert cut[4] == "... and 2 more rows"


def test_the_table_shows_every_cell_of_every_row() -> None:
    assert str(_small()).splitlines() == [
        "name      numel  grad  reached by  optimizer  lr   wd    momentum  mode   expects  status",
        "  ".join("-" * n for n in (8, 5, 4, 10, 9, 3, 4, 8, 5, 7, 9)),
        "0.weight  1      no    none        -          -    -     -         train  -        frozen",
        "0.bias    1      no    none        -          -    -     -         train  -        frozen",
        "1.weight  1      yes   main        0/0        0.5  0.25  no        train  -        trains",
        "1.bias    1      yes   main        -          -    -     -         train  -        "
        "irregular",
        "irregular 1.bias: trainable but in no optimizer",
        "trainable 2 of 4 parameters (50.00%) in 2 tensors; reached 2 of 2; irregular 1",
    ]


def test_a_row_shows_both_its_losses_its_momentum_its_mode_and_what_the_spec_expects() -> None:
    model = nn.Linear(1, 1)
    model.bias.requires_grad_(False)
    opt = torch.optim.SGD([model.weight], lr=0.5, momentum=0.9)
    model(torch.ones(1, 1)).sum().backward()
    opt.step()  # a momentum buffer now
    model.eval()
    out = model(torch.ones(1, 1))
    book = ledger(model, {"a": out.sum(), "b": (2 * out).sum()}, opt, {"weight": "moves"})
    assert str(book).splitlines()[2:4] == [
        "weight  1      yes   a,b         0/0        0.5  0   yes       eval  moves    trains",
        "bias    1      no    none        -          -    -   -         eval  -        frozen",
    ]


def test_a_frozen_row_names_every_risk_of_its_group_and_every_loss_that_reaches_it() -> None:
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
    model(torch.ones(1, 1)).sum().backward()
    opt.step()  # a non-zero momentum buffer
    out = model(torch.ones(1, 1))
    model.weight.requires_grad_(False)  # frozen after the forward: reached anyway
    book = ledger(model, {"a": out.sum(), "b": (2 * out).sum()}, opt)
    assert book.rows[0].reasons == (
        "frozen but in optimizer 0 group 0, where weight_decay=0.5 shrinks it on every step; "
        "optimizer state 'momentum_buffer' is non-zero and keeps moving it",
        "frozen but reached by a, b",
    )


def test_several_losses_given_as_a_list_are_named_by_their_index() -> None:
    model = nn.Linear(1, 1)
    out = model(torch.ones(1, 1))
    book = ledger(model, [out.sum(), (2 * out).sum()])
    assert book.losses == ("loss[0]", "loss[1]")
    assert [r.reached_by for r in book.rows] == [("loss[0]", "loss[1]")] * 2
    assert ledger(model, out.sum()).losses == ("loss",)


def test_each_refusal_names_the_caller_and_what_was_given() -> None:
    model = two_heads()
    with pytest.raises(IsolationTypeError, match=r"^report\(\): every output must be a torch"):
        ledger(model, [1.0], caller="report()")  # type: ignore[list-item]
    with pytest.raises(IsolationTypeError, match=r"selectors to \['still', .*\], got int$"):
        ledger(model, spec=3)
    with pytest.raises(SelectorError, match=r"report\(\)\(spec\['nowhere'\]\)"):
        ledger(model, spec={"nowhere": "still"}, caller="report()")


def test_the_mode_of_an_fsdp2_unit_left_unsharded_is_read_from_its_module() -> None:
    # Between forward and backward the head registers unsharded temporaries, not the sharded
    # parameters the rows are named by: the owner is found through the sharded one.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = Net()
        _fully_shard(net, head_stays_unsharded=True)
        net.eval()
        book = ledger(net, net(torch.randn(2, 3)).sum())
    finally:
        dist.destroy_process_group()
    assert {r.name: (r.mode, r.reached_by) for r in book.rows} == {
        "encoder.weight": ("eval", ()),
        "encoder.bias": ("eval", ()),
        "head.weight": ("eval", ("loss",)),
        "head.bias": ("eval", ("loss",)),
    }


def test_what_a_spec_expects_is_read_by_its_first_word() -> None:
    model = two_heads()  # nothing frozen yet
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.0", epoch=1, lr=0.1)])
    reasons = {r.name: r.reasons for r in ledger(model, spec=spec).rows}
    assert reasons["trunk.0.weight"] == ("trainable but the spec expects it still until epoch 1",)
    assert reasons["trunk.1.weight"] == ("trainable but the spec expects it still",)
    assert reasons["head.weight"] == ()
    model["head"].requires_grad_(False)
    rows = {r.name: r for r in ledger(model, spec={"head": "rows", "aux": "moves"}).rows}
    assert rows["head.weight"].reasons == ("frozen but the spec expects it to move (rows)",)
    assert rows["head.weight"].expects == "rows" and rows["aux.weight"].reasons == ()


def test_a_group_without_weight_decay_shows_none_of_it() -> None:
    model = nn.Linear(1, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5)  # its groups have no weight_decay
    row = ledger(model, optimizer=opt).rows[0]
    assert (row.optimizer, row.group, row.lr, row.weight_decay) == (0, 0, 0.5, 0.0)


def test_the_walk_and_the_model_check_name_the_caller() -> None:
    with pytest.raises(IsolationTypeError, match=r"^report\(\): model must be a torch.nn.Module"):
        ledger("model", caller="report()")  # type: ignore[arg-type]
    model = nn.Linear(2, 1)
    calls: list[int] = []

    def once(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("only once")
        return model(x)  # type: ignore[no-any-return]

    loss = checkpoint(once, torch.ones(1, 2, requires_grad=True), use_reentrant=True).sum()
    with pytest.raises(BlindSpotError, match=r"^report\(\): re-running the reentrant checkpoint"):
        ledger(model, loss, caller="report()")
    model.weight._is_flat_param = True  # type: ignore[attr-defined]  # as FSDP1 flags one
    with pytest.raises(ShardedGraphError, match=r"^report\(\): the graph's leaves include 1 FSDP1"):
        ledger(model, model(torch.ones(1, 2)).sum(), caller="report()")


def test_the_ledger_counts_the_optimizers_it_searched() -> None:
    model = nn.Linear(1, 1)
    first = torch.optim.SGD([model.weight], lr=0.1)
    second = torch.optim.SGD([model.bias], lr=0.1)
    assert ledger(model, optimizer=[first, second]).optimizers == 2
    assert ledger(model, optimizer=first).optimizers == 1
    assert ledger(model).optimizers is None
