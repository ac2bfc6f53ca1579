"""optimizer_exposure against a real step, for every optimizer in torch.optim: after some
training, a layer is frozen with its ``.grad`` None, zero or stale; the prediction
``moves_on_step`` must be what the next ``step()`` does to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from isolate.errors import IsolationWarning, SpecError
from isolate.exposure import optimizer_exposure, zero_grad_risks
from isolate.freezing import freeze
from isolate.spec import IsolationSpec, Thaw

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

DENSE: dict[str, Factory] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "SGD-weight-decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
    "SGD-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "SGD-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "Adam-weight-decay": lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1),
    "Adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True),
    "Adam-fused": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.1),
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.1),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.1),
    "NAdam-decoupled": lambda p: torch.optim.NAdam(
        p, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.1),
    "RAdam-decoupled": lambda p: torch.optim.RAdam(
        p, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.1),
    "RMSprop-momentum": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9),
    "RMSprop-centered": lambda p: torch.optim.RMSprop(p, lr=0.1, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.1),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Adagrad-weight-decay": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1),
    "Adagrad-fused": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "Adadelta-weight-decay": lambda p: torch.optim.Adadelta(p, lr=1.0, weight_decay=0.1),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.1),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.1),
    "Adafactor-no-decay": lambda p: torch.optim.Adafactor(p, lr=0.1, weight_decay=0.0),
    "Muon": lambda p: torch.optim.Muon([q for q in p if q.dim() == 2], lr=0.1),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=2),
}

SPARSE: dict[str, Factory] = {
    "SGD-sparse": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD-sparse-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adagrad-sparse": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=0.1),
}


def test_every_optimizer_in_torch_optim_is_covered() -> None:
    classes = {
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    }
    covered = {type(f([nn.Parameter(torch.ones(2, 2))])) for f in DENSE.values()}
    covered |= {torch.optim.SparseAdam}
    assert classes <= covered, sorted(c.__name__ for c in classes - covered)


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))  # type: ignore[no-any-return]

    def data(self, step: int) -> torch.Tensor:
        return torch.randn(6, 3, generator=torch.Generator().manual_seed(step))


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Embedding(10, 3, sparse=True)
        self.second = nn.Embedding(10, 3, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.first(x) * self.second(x)).sum(-1)

    def data(self, step: int) -> torch.Tensor:
        return torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(step))


def step(model: nn.Module, opt: torch.optim.Optimizer, at: int) -> None:
    def closure() -> torch.Tensor:
        for p in model.parameters():
            if p.requires_grad:  # the frozen .grad stays as the case set it
                p.grad = None
        loss = model(model.data(at)).pow(2).mean()  # type: ignore[operator]
        loss.backward()
        return loss

    if isinstance(opt, torch.optim.LBFGS):
        opt.step(closure)
    else:
        closure()
        opt.step()


def set_grad(p: nn.Parameter, kind: str, last: dict[str, torch.Tensor | None], name: str) -> None:
    if kind == "none":
        p.grad = None
    elif kind == "stale":  # the gradient of the step before the freeze
        p.grad = last[name]
    elif p.grad is not None and p.grad.is_sparse:
        p.grad = last[name] * 0 if kind == "zero" else torch.zeros_like(p).to_sparse()  # type: ignore[operator]
    else:
        p.grad = torch.zeros_like(p)


CASES = [
    (name, factory, model, trained, grad)
    for group, model in ((DENSE, Dense), (SPARSE, Sparse))
    for name, factory in group.items()
    for trained in (0, 3)
    for grad in ("none", "zero", "stale", "empty")
    if model is Sparse or grad != "empty"
]


@pytest.mark.parametrize(
    ("factory", "model_class", "trained", "grad"),
    [c[1:] for c in CASES],
    ids=[f"{c[0]}-trained{c[3]}-grad_{c[4]}" for c in CASES],
)
def test_optimizer_exposure_predicts_the_real_step(
    factory: Factory, model_class: type, trained: int, grad: str
) -> None:
    model = model_class()
    opt = factory(list(model.parameters()))
    last: dict[str, torch.Tensor | None] = {}
    for at in range(trained):
        step(model, opt, at)
    if trained:
        last = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    else:
        model(model.data(99)).pow(2).mean().backward()
        last = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.first.requires_grad_(False)
    for name, p in model.first.named_parameters(prefix="first"):
        if any(p is q for g in opt.param_groups for q in g["params"]):
            set_grad(p, grad, last, name)
    exposures = optimizer_exposure(opt, model)
    held = [
        n
        for n, p in model.first.named_parameters(prefix="first")
        if any(p is q for g in opt.param_groups for q in g["params"])
    ]
    assert [e.name for e in exposures] == held
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step(model, opt, 100)
    moved = {n: not torch.equal(before[n], p) for n, p in model.named_parameters()}
    for e in exposures:
        assert e.moves_on_step == moved[e.name], (e, moved[e.name])
        if e.grad == "zero" or (e.grad == "none" and e.steps_without_grad):
            assert e.at_risk == moved[e.name], (e, moved[e.name])


def test_lbfgs_history_is_an_exposure_and_the_spec_refuses_it() -> None:
    model = Dense()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    for at in range(3):
        step(model, opt, at)
    with pytest.warns(IsolationWarning, match=r"the next step moves 2 of them"):
        handle = freeze(model, "first", optimizer=opt)
    assert [e.moves_on_step for e in handle.exposures] == [True, True]
    assert "LBFGS's search direction and history" in handle.exposures[0].reasons[0]
    handle.restore()
    fresh = Dense()
    lbfgs = torch.optim.LBFGS(fresh.parameters(), lr=0.1)
    with pytest.raises(SpecError, match=r"optimizer 0 \(LBFGS\) steps every parameter"):
        IsolationSpec(freeze=["first"]).apply(fresh, lbfgs)
    assert all(p.requires_grad for p in fresh.parameters())
    spec = IsolationSpec(freeze=["first"], thaw=[Thaw("first", epoch=1, lr=0.1)])
    handle = spec.apply(fresh)
    try:
        trainable = torch.optim.LBFGS([p for p in fresh.parameters() if p.requires_grad])
        with pytest.raises(SpecError, match=r"nor thawed groups added \(\['first'\]\)"):
            handle.attach(trainable)
    finally:
        handle.restore()
    with IsolationSpec(freeze=["first"]).applied(fresh) as handle:
        handle.attach(torch.optim.LBFGS([p for p in fresh.parameters() if p.requires_grad]))


def test_sparse_momentum_and_stale_sparse_grads_do_not_crash_the_audits() -> None:
    model = Sparse()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for at in range(2):
        step(model, opt, at)
    assert opt.state[model.first.weight]["momentum_buffer"].is_sparse
    assert model.first.weight.grad is not None and model.first.weight.grad.is_sparse
    model.first.requires_grad_(False)  # the stale sparse gradient stays
    (exposure,) = optimizer_exposure(opt, model)
    assert exposure.grad == "nonzero" and exposure.moves_on_step
    assert exposure.reasons == (
        "optimizer state 'momentum_buffer' is non-zero and keeps moving it",
    )
    model.first.requires_grad_(True)
    with pytest.warns(IsolationWarning, match=r"still hold 1 frozen parameter"):
        handle = freeze(model, "first", optimizer=opt)  # drops the stale .grad
    try:
        assert [(e.name, e.grad, e.at_risk) for e in handle.exposures] == [
            ("first.weight", "none", True)
        ]
    finally:
        handle.restore()


HISTORY = ("d", "prev_flat_grad", "old_dirs", "old_stps")


def _history(state: dict[str, Any], key: str) -> list[torch.Tensor]:
    kept = state.get(key, [])
    return list(kept) if isinstance(kept, list) else [kept]


@pytest.mark.parametrize("alone", [*HISTORY, None])
def test_each_piece_of_lbfgs_history_alone_moves_a_frozen_parameter(alone: str | None) -> None:
    """LBFGS keeps its history over the flat view of every parameter it holds. ``second``
    (the last 4 of 16 entries, after 12 of ``first``) is frozen after 3 steps, its entries
    wiped from every piece of history but ``alone``: that one piece still moves it on the
    next real step (on the next batch), and the prediction says so; with every piece wiped,
    nothing moves it."""
    model = Dense()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    for at in range(3):
        step(model, opt, at)
    model.second.requires_grad_(False)
    for p in model.second.parameters():
        p.grad = None
    state = opt.state[model.first.weight]
    assert len(state["old_dirs"]) == len(state["old_stps"]) > 0
    for key in HISTORY:
        for t in _history(state, key):
            assert t.numel() == 16 and bool(t[12:].ne(0).any())  # every piece held it
            if key != alone:
                t[12:] = 0
    exposures, steps = optimizer_exposure(opt, model), len(state["old_dirs"])
    before = {n: p.detach().clone() for n, p in model.second.named_parameters(prefix="second")}
    step(model, opt, 3)
    moved = [not torch.equal(before[n], p) for n, p in model.second.named_parameters("second")]
    assert moved == [alone is not None] * 2
    assert [(e.name, e.moves_on_step) for e in exposures] == [
        ("second.weight", alone is not None),
        ("second.bias", alone is not None),
    ]
    said = (
        f"LBFGS's search direction and history ({steps} steps) hold it, so its steps move it, "
        f"whatever its .grad (None included)"
    )
    assert [e.reasons for e in exposures] == [(said,) if alone else ()] * 2


def test_lbfgs_history_of_another_group_is_not_this_parameters() -> None:
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.LBFGS([p], lr=0.1)
    opt.state[p] = {"d": torch.ones(3)}
    assert zero_grad_risks(opt, {"params": []}, p) == ()
    assert zero_grad_risks(opt, opt.param_groups[0], p) != ()


def test_sparse_adam_moves_a_frozen_row_a_one_row_zero_gradient_stores() -> None:
    model = Sparse()
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.1)
    for at in range(2):
        step(model, opt, at)
    model.first.requires_grad_(False)
    row = int(model.data(0)[0])  # a row the steps moved: its first moment is non-zero
    model.first.weight.grad = torch.sparse_coo_tensor(
        [[row]], torch.zeros(1, 3), (10, 3), check_invariants=True
    )
    (exposure,) = optimizer_exposure(opt, model)
    before = model.first.weight.detach().clone()
    step(model, opt, 100)
    assert not torch.equal(before, model.first.weight)
    assert (exposure.grad, exposure.moves_on_step) == ("zero", True)
    assert exposure.reasons == ("optimizer state 'exp_avg' is non-zero and keeps moving it",)
