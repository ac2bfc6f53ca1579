"""Twelve isolation bugs users reported, each planted in a small reference implementation of
its method and caught by the method's contract, with the clause named; the implementations
without the bug hold their contracts over three seeds.

Every run checks its contracts at every step (``check_every(1)``), through the same
:class:`~isolate.spec.cadence.Loop` a training loop or the Lightning callback drives.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import isolate
from isolate.errors import ContractError
from isolate.spec import IsolationSpec

STEPS = 4
Losses = tuple[torch.Tensor, dict[str, torch.Tensor]]


@dataclass
class Method:
    """A reference implementation: a model, its spec, an optimizer, a step's losses, and
    what runs after the optimizer step (an EMA update)."""

    model: nn.Module
    spec: IsolationSpec
    optimizer: torch.optim.Optimizer
    losses: Callable[[torch.Tensor, torch.Tensor], Losses]
    after_step: Callable[[], None] = lambda: None


def train(method: Method, seed: int) -> dict[str, Any]:
    """A few steps of training with every contract checked at every step; the verdicts."""
    gen = torch.Generator().manual_seed(seed)
    handle = method.spec.apply(method.model, method.optimizer)
    loop = handle.check_every(1)
    try:
        for step in range(STEPS):
            loop.begin_step(epoch=0, step=step)
            method.model.train()  # as Lightning does at every epoch's start
            x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
            total, named = method.losses(x, y)
            loop.before_backward(total, named)
            total.backward()
            method.optimizer.step()
            method.after_step()
            method.optimizer.zero_grad(set_to_none=True)
            loop.end_step()
        loop.finish()
    finally:
        handle.restore()
    return handle.contracts.verdicts


def mlp(*widths: int, norm: bool = False, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths[:-1]):
        layers += [nn.Linear(a, b), *([nn.BatchNorm1d(b)] if norm else []), nn.ReLU()]
        layers += [nn.Dropout(dropout)] if dropout else []
    layers.append(nn.Linear(widths[-2], widths[-1]))
    return nn.Sequential(*layers)


@torch.no_grad()
def ema_update(target: nn.Module, online: nn.Module, decay: float) -> None:
    """The EMA step as timm's ModelEmaV3 does it: floats lerp, integers are copied."""
    for t, o in zip(target.state_dict().values(), online.state_dict().values(), strict=True):
        if t.is_floating_point():
            t.lerp_(o, 1 - decay)
        else:
            t.copy_(o)


# -- distillation: a frozen teacher ---------------------------------------------------------


def distillation(seed: int, bug: str | None = None) -> Method:
    """Knowledge distillation from a teacher with BatchNorm and dropout into a student."""
    torch.manual_seed(seed)
    model = nn.ModuleDict(
        {"teacher": mlp(6, 16, 3, norm=True, dropout=0.3), "student": mlp(6, 8, 3)}
    )
    contracts = [{"kind": "teacher", "select": "teacher"}]
    if bug == "teacher_in_optimizer":
        # huangzongmou/yolov8_Distillation#16: the teacher's parameters are added to the
        # student's optimizer (and left trainable), though it runs under no_grad.
        spec = IsolationSpec(contracts=contracts)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif bug == "teacher_trains_batchnorm":
        # The same report: teacher.eval() once, then the training loop's model.train() puts
        # its BatchNorm (and dropout) back in train mode; its statistics drift.
        model["teacher"].requires_grad_(False).eval()
        spec = IsolationSpec(contracts=contracts)
        optimizer = torch.optim.SGD(model["student"].parameters(), lr=0.05, momentum=0.9)
    else:
        spec = IsolationSpec(freeze=["teacher"], mode="eval", contracts=contracts)
        optimizer = torch.optim.SGD(model["student"].parameters(), lr=0.05, momentum=0.9)

    def losses(x: torch.Tensor, y: torch.Tensor) -> Losses:
        with torch.no_grad():
            soft = F.softmax(model["teacher"](x) / 2.0, dim=1)
        logits = model["student"](x)
        kd = F.kl_div(F.log_softmax(logits / 2.0, dim=1), soft, reduction="batchmean")
        ce = F.cross_entropy(logits, y)
        return ce + kd, {"ce": ce, "kd": kd}

    return Method(model, spec, optimizer, losses)


# -- an EMA teacher with BatchNorm (mean teacher) -------------------------------------------


class Compiled(nn.Module):
    """What ``torch.compile(module)`` returns, as far as names go: the module under
    ``_orig_mod``, so every ``state_dict`` key starts with ``_orig_mod.``. (A real compile
    costs seconds; the forward runs the module itself, as a compiled one computes it.)"""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._orig_mod(x)


def mean_teacher(seed: int, bug: str | None = None) -> Method:
    """A student with BatchNorm and its EMA teacher, which gives consistency targets."""
    torch.manual_seed(seed)
    student = mlp(6, 16, 3, norm=True)
    teacher = copy.deepcopy(student).requires_grad_(False).eval()
    model = nn.ModuleDict({"student": Compiled(student) if bug else student, "teacher": teacher})
    decay = 0.9
    # The teacher is frozen to gradients and held in eval mode (its statistics move only by
    # the EMA); the drift check leaves an EMA target alone, its contract checks it instead.
    spec = IsolationSpec(
        freeze=["teacher"],
        mode="eval",
        contracts=[{"kind": "ema", "target": "teacher", "online": "student", "decay": decay}],
    )
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)

    def losses(x: torch.Tensor, y: torch.Tensor) -> Losses:
        with torch.no_grad():
            target = F.softmax(teacher(x + 0.1 * torch.randn_like(x)), dim=1)
        logits = model["student"](x)
        ce = F.cross_entropy(logits, y)
        consistency = F.mse_loss(F.softmax(logits, dim=1), target)
        return ce + consistency, {"ce": ce, "consistency": consistency}

    @torch.no_grad()
    def after_step() -> None:
        if bug == "ema_skips_buffers":
            # saltoricristiano/cosmix-uda#21 (and YU1ut/MixMatch-pytorch#16): the update
            # loops over parameters() only; the teacher's BatchNorm statistics never move.
            for t, o in zip(teacher.parameters(), student.parameters(), strict=True):
                t.mul_(decay).add_(o, alpha=1 - decay)
        elif bug == "ema_scales_integers":
            # hnuzhy/SSDA-YOLO#21: every state_dict entry is multiplied by the decay, the
            # integer num_batches_tracked too, which truncates it.
            for t, o in zip(
                teacher.state_dict().values(), student.state_dict().values(), strict=True
            ):
                t.copy_(t * decay + (1 - decay) * o)
        elif bug == "ema_never_updated":
            # wandb/senpai#2899: the model is compiled, its keys start with "_orig_mod.", the
            # EMA's do not: the update matches no key and the teacher never moves.
            ema = teacher.state_dict()
            for key, o in model["student"].state_dict().items():
                if key in ema and ema[key].is_floating_point():
                    ema[key].lerp_(o, 1 - decay)
        else:
            ema_update(teacher, student, decay)

    return Method(model, spec, optimizer, losses, after_step)


# -- BYOL: an EMA target behind a stop-gradient ---------------------------------------------


def byol(seed: int, bug: str | None = None) -> Method:
    """BYOL: the online network predicts the EMA target network's projection of another view."""
    torch.manual_seed(seed)
    online = nn.Sequential(mlp(6, 16, 8, norm=True), mlp(8, 8, 4))
    model = nn.ModuleDict(
        {"online": online, "predictor": mlp(4, 8, 4), "target": copy.deepcopy(online)}
    )
    decay = 0.99
    contracts = [{"kind": "ema", "target": "target", "online": "online", "decay": decay}]
    if bug is None:
        spec = IsolationSpec(freeze=["target"], mode="eval", contracts=contracts)
    else:
        spec = IsolationSpec(contracts=contracts)  # and the target left trainable
    optimizer = torch.optim.SGD(
        [*model["online"].parameters(), *model["predictor"].parameters()], lr=0.05
    )

    def losses(x: torch.Tensor, y: torch.Tensor) -> Losses:
        v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
        p1 = model["predictor"](model["online"](v1))
        if bug == "target_gets_gradient":
            # Lightning-Universe/lightning-bolts#801 (arxyzan/data2vec-pytorch#8 alike): the
            # target's projection is compared without a stop-gradient.
            z2 = model["target"](v2)
        else:
            z2 = isolate.stop_gradient(model["target"](v2))
        loss = 2 - 2 * F.cosine_similarity(p1, z2).mean()
        return loss, {"byol": loss}

    return Method(
        model, spec, optimizer, losses, lambda: ema_update(model["target"], online, decay)
    )


# -- SimSiam: one encoder, a stop-gradient on the target branch ------------------------------


def simsiam(seed: int, bug: str | None = None) -> Method:
    """SimSiam: the predictor's output of one view against the other view's projection."""
    torch.manual_seed(seed)
    model = nn.ModuleDict({"encoder": mlp(6, 16, 8, norm=True), "predictor": mlp(8, 4, 8)})
    spec = IsolationSpec(
        contracts=[
            {
                "kind": "stop_gradient",
                "loss": "simsiam",
                "blocked": "encoder",
                "through": "predictor",
            }
        ]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def losses(x: torch.Tensor, y: torch.Tensor) -> Losses:
        z1 = model["encoder"](x + 0.1 * torch.randn_like(x))
        z2 = model["encoder"](x + 0.1 * torch.randn_like(x))
        p1, p2 = model["predictor"](z1), model["predictor"](z2)
        # lightly-ai/lightly#559: the stop-gradient on the targets is left out.
        t1, t2 = (z1, z2) if bug == "no_stop_gradient" else isolate.stop_gradient((z1, z2))
        loss = -(F.cosine_similarity(p1, t2).mean() + F.cosine_similarity(p2, t1).mean()) / 2
        return loss, {"simsiam": loss}

    return Method(model, spec, optimizer, losses)


# -- DANN: a domain classifier behind a gradient reversal -----------------------------------


def dann(seed: int, bug: str | None = None) -> Method:
    """Domain-adversarial training: the features learn to fool a domain classifier."""
    torch.manual_seed(seed)
    reversal: nn.Module = {
        None: isolate.GradientScale(-0.3),
        "reversal_missing": nn.Identity(),  # VisionLearningGroup/DAL#1: never applied
        "reversal_wrong_sign": isolate.GradientScale(0.3),  # CuthbertCai/pytorch_DANN#13
    }[bug]
    model = nn.ModuleDict(
        {
            "features": mlp(6, 16, 8),
            "label": mlp(8, 8, 3),
            "domain": nn.Sequential(reversal, mlp(8, 8, 2)),
        }
    )
    spec = IsolationSpec(
        contracts=[
            {
                "kind": "reversal",
                "loss": "domain",
                "features": "features",
                "classifier": "domain.1",
                "scale": 0.3,
            }
        ]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def losses(x: torch.Tensor, y: torch.Tensor) -> Losses:
        source, target = x[:8], x[8:] + 0.5
        features = model["features"](torch.cat([source, target]))
        label = F.cross_entropy(model["label"](features[:8]), y[:8])
        domains = torch.cat([torch.zeros(8), torch.ones(8)]).long()
        domain = F.cross_entropy(model["domain"](features), domains)
        return label + domain, {"label": label, "domain": domain}

    return Method(model, spec, optimizer, losses)


# -- an online probe ------------------------------------------------------------------------


def online_probe(seed: int, bug: str | None = None) -> Method:
    """A linear probe trained alongside, on the backbone's features, to monitor them."""
    torch.manual_seed(seed)
    probe = mlp(8, 3)
    model = nn.ModuleDict(
        {
            "backbone": mlp(6, 16, 8, norm=True),
            "head": mlp(8, 3),
            # The bug: the probe reads the features plainly instead of through Detached.
            "probe": probe if bug == "probe_not_detached" else isolate.Detached(probe),
        }
    )
    spec = IsolationSpec(contracts=[{"kind": "probe", "select": "probe", "loss": "probe"}])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def losses(x: torch.Tensor, y: torch.Tensor) -> Losses:
        features = model["backbone"](x)
        main = F.cross_entropy(model["head"](features), y)
        probe_loss = F.cross_entropy(model["probe"](features), y)
        return main + probe_loss, {"main": main, "probe": probe_loss}

    return Method(model, spec, optimizer, losses)


# -- a speculator head ----------------------------------------------------------------------


def speculator(seed: int, bug: str | None = None) -> Method:
    """A draft head that learns to predict the next token from the backbone's hidden states,
    which it must not change (vllm-project/speculators#846)."""
    torch.manual_seed(seed)
    model = nn.ModuleDict(
        {"backbone": mlp(6, 16, 8), "lm_head": mlp(8, 3), "speculator": mlp(8, 8, 3)}
    )
    spec = IsolationSpec(
        contracts=[{"kind": "stop_gradient", "loss": "speculator", "blocked": "backbone"}]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def losses(x: torch.Tensor, y: torch.Tensor) -> Losses:
        hidden = model["backbone"](x)
        lm = F.cross_entropy(model["lm_head"](hidden), y)
        draft_in = hidden if bug == "speculator_leaks" else hidden.detach()
        draft = F.cross_entropy(model["speculator"](draft_in), y.roll(1))
        return lm + draft, {"lm": lm, "speculator": draft}

    return Method(model, spec, optimizer, losses)


# -- a convolution cut off by a detach ------------------------------------------------------


class SegNet(nn.Module):
    def __init__(self, cut: bool) -> None:
        super().__init__()
        # No bias before BatchNorm: its gradient would be exactly zero, and the trains
        # contract would say (rightly) that it never changes.
        self.stem = nn.Conv1d(1, 4, 3, padding=1, bias=False)
        self.body = nn.Sequential(nn.BatchNorm1d(4), nn.ReLU(), nn.Conv1d(4, 4, 3, padding=1))
        self.head = nn.Conv1d(4, 3, 1)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.stem(x.unsqueeze(1))
        # PRBonn/lidar-bonnetal#99: a .detach() left in the forward cuts the stem off; the
        # run trains and looks normal while the stem keeps its initial weights.
        return self.head(self.body(stem.detach() if self.cut else stem)).mean(dim=2)


def conv_cut_off(seed: int, bug: str | None = None) -> Method:
    torch.manual_seed(seed)
    model = SegNet(cut=bug == "detach_cuts_conv")
    spec = IsolationSpec(contracts=[{"kind": "trains", "select": ["stem", "body"], "within": 1}])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def losses(x: torch.Tensor, y: torch.Tensor) -> Losses:
        loss = F.cross_entropy(model(x), y)
        return loss, {"seg": loss}

    return Method(model, spec, optimizer, losses)


METHODS = {
    "distillation": distillation,
    "mean_teacher": mean_teacher,
    "byol": byol,
    "simsiam": simsiam,
    "dann": dann,
    "online_probe": online_probe,
    "speculator": speculator,
    "conv_cut_off": conv_cut_off,
}

# method, planted bug, the contract and clause that must catch it, a detail of the message
BUGS = [
    ("distillation", "teacher_in_optimizer", "teacher:teacher", "in no optimizer",
     r"an optimizer holds \['teacher.0.weight \(optimizer 0, group 0\)'"),
    ("distillation", "teacher_trains_batchnorm", "teacher:teacher", "in eval mode",
     r"\['teacher.1', 'teacher.3'\] run in train mode"),
    ("mean_teacher", "ema_skips_buffers", "ema:teacher", "moves",
     r"\['1.running_mean \(buffer\)', '1.running_var \(buffer\)'\] did not move"),
    ("mean_teacher", "ema_scales_integers", "ema:teacher",
     "integer buffers are copied from the online network",
     r"\['1.num_batches_tracked = 0, expected 1'\]"),
    ("mean_teacher", "ema_never_updated", "ema:teacher", "moves",
     r"\['0.weight \(parameter\)', .* did not move"),
    ("byol", "target_gets_gradient", "ema:target", "gets no gradient",
     r"loss 'byol' reaches \['target.0.0.weight'"),
    ("simsiam", "no_stop_gradient", "stop_gradient:simsiam", "does not reach the blocked side",
     r"reaches \['encoder.0.weight', .* outside the route through 'predictor'"),
    ("dann", "reversal_missing", "reversal:domain", "reversed at the features",
     r"is \+1 times .*, expected -0.3 .*; the reversal is missing"),
    ("dann", "reversal_wrong_sign", "reversal:domain", "reversed at the features",
     r"is \+0.3 times .*; the sign is wrong"),
    ("online_probe", "probe_not_detached", "probe:probe", "its loss reaches only the probe",
     r"loss 'probe' also reaches \['backbone.0.weight'"),
    ("speculator", "speculator_leaks", "stop_gradient:speculator",
     "does not reach the blocked side", r"loss 'speculator' reaches \['backbone.0.weight'"),
    ("conv_cut_off", "detach_cuts_conv", "trains:stem", "reached by the loss",
     r"does not reach \['stem.weight'\]"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "bug", "contract", "clause", "detail"), BUGS, ids=[b[1] for b in BUGS]
)
def test_each_planted_bug_is_caught_by_its_contract(
    method: str, bug: str, contract: str, clause: str, detail: str, one_thread: None
) -> None:
    with pytest.raises(
        ContractError,
        match=rf"contract '{contract}' \(\w+\) breaks its clause '{clause}': .*{detail}",
    ):
        train(METHODS[method](0, bug), seed=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_corrected_implementations_hold_their_contracts(
    method: str, seed: int, one_thread: None
) -> None:
    verdicts = train(METHODS[method](seed), seed)
    assert verdicts, "every implementation declares its contract"
    for name, verdict in verdicts.items():
        for clause, seen in verdict["clauses"].items():
            assert seen["checked"] > 0, f"{name}: '{clause}' was never checked"
            assert seen["violated"] == 0, seen["first"]


def test_there_are_twelve_planted_bugs_over_eight_methods() -> None:
    assert len(BUGS) == 12 and {b[0] for b in BUGS} == set(METHODS)
