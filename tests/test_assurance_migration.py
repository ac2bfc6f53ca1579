"""Migration and leaving under what users write: regexes converted exactly or refused, and
``plain_checkpoint`` taking whatever ``configure_optimizers()`` returns."""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from isolate.errors import CheckpointMismatchError, IsolationTypeError, SpecError
from isolate.cli import main
from isolate.interop.leave import plain_checkpoint
from isolate.interop.migrate import from_finetuning_scheduler, regex_to_glob
from isolate.spec import IsolationSpec, Thaw


def bert(layers: int = 12) -> nn.Module:
    """Parameter names as in a BERT encoder: an 'output.dense' under attention too."""
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.layer = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.attention = nn.Module()
        layer.attention.output = nn.Module()
        layer.attention.output.dense = nn.Linear(2, 2)
        layer.output = nn.Module()
        layer.output.dense = nn.Linear(2, 2)
        model.encoder.layer.append(layer)
    model.classifier = nn.Linear(2, 2)
    root = nn.Module()
    root.model = model
    return root


NAMES = [n for n, _ in bert().named_parameters()] + [
    "model.encoder.layer.1x.output.dense.weight",  # what '.' and '*' would let through
    "model_encoder.layer.1.output.dense.weight",
    "model.encoder.layer.12.output.dense.bias",
]

REGEXES = [
    r"model\.encoder\.layer\.\d+\.output\.dense\..*",
    r"model\.encoder\.layer\.[0-9]+\.output\..*",
    r"model\.encoder\.layer\.\d\.output\.dense\..*",
    r"model\.encoder\.layer\.1[01]\..*",
    r"model\.encoder\.layer\.1\..*",
    r"model.encoder.layer.1.output.dense.weight$",
    r"^model\.classifier\..+",
    r"model\.encoder\.layer\.\d*\.output",
    r"model\.encoder\.layer\.(0|1)\..*",
    r"model\.encoder\.layer\.[!1]\..*",
    r"model\.classifier\.(weight|bias)",
    r"model.classifier",
    r"model\.encoder\.layer\.1.?\.output",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_a_converted_regex_matches_exactly_what_the_regex_matches(regex: str) -> None:
    glob = regex_to_glob(regex)
    if glob is None:
        return  # refused: from_finetuning_scheduler says so (below)
    by_regex = [n for n in NAMES if re.match(regex, n)]
    by_glob = [n for n in NAMES if fnmatch.fnmatchcase(n, glob)]
    assert by_glob == by_regex, glob


def test_repeated_digits_are_refused_not_widened() -> None:
    regex = r"model\.encoder\.layer\.\d+\.output\.dense\..*"
    assert regex_to_glob(regex) is None  # 'layer.*.output.dense.*' also takes attention.output
    assert regex_to_glob(r"model\.layer\.[0-9]+\.w") is None
    assert regex_to_glob(r"model\.layer\.\d\.w") == "model.layer.[0-9].w*"
    fts = {0: {"params": ["model.classifier.weight"]}, 1: {"params": [regex], "lr": 1e-3}}
    with pytest.raises(
        SpecError, match=r"^from_finetuning_scheduler\(\): phase 1: the regex .* has no glob"
    ):
        from_finetuning_scheduler(fts)
    model = bert()
    spec = IsolationSpec.from_dict(from_finetuning_scheduler(fts, model=model))
    handle = spec.apply(model)
    try:
        group = handle.plan.group("phase_1").params
        assert list(group) == [n for n, _ in model.named_parameters() if re.match(regex, n)]
        assert len(group) == 24 and not any("attention" in n for n in group)
    finally:
        handle.restore()


def test_the_converter_command_resolves_regexes_on_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bert_factory.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_assurance_migration import bert\n"
        "def build():\n    return bert(3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        "0:\n  params: [model.classifier.weight, model.classifier.bias]\n"
        "1:\n  params: ['model\\.encoder\\.layer\\.\\d+\\.output\\.dense\\..*']\n  lr: 0.001\n"
    )
    assert main(["migrate", str(schedule)]) == 2
    assert "phase 1: the regex" in capsys.readouterr().err
    assert main(["migrate", str(schedule), "--model", "bert_factory:build"]) == 0
    spec = IsolationSpec.from_dict(yaml.safe_load(capsys.readouterr().out))
    assert spec.thaw[0].selectors == tuple(
        f"model.encoder.layer.{i}.output.dense.{k}" for i in range(3) for k in ("weight", "bias")
    )
    sys.modules.pop("bert_factory", None)


# --------------------------------------------------------------------------------------------
# plain_checkpoint: what configure_optimizers() returns, in every form Lightning takes.


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.trunk(x)))  # type: ignore[no-any-return]


def isolated_checkpoint() -> dict[str, Any]:
    """A checkpoint as the callback writes it, from a plain loop with the same handle."""
    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=0.01)])
    handle = spec.apply(model)
    with pytest.warns(UserWarning, match="took 2 frozen parameters out"):
        handle.attach(opt, [sched])
    for epoch in range(2):
        handle.step(epoch=epoch, step=epoch)
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "callbacks": {"IsolationCallback": handle.state_dict()},
    }
    handle.restore()
    return checkpoint


def configured(form: str, model: nn.Module) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {
        "optimizer": opt,
        "list": [opt],
        "dict": {"optimizer": opt, "lr_scheduler": sched},
        "dict-with-config": {"optimizer": opt, "lr_scheduler": {"scheduler": sched}},
        "dict-alone": {"optimizer": opt},
        "list-of-dicts": [{"optimizer": opt, "lr_scheduler": sched}],
        "two-lists": ([opt], [sched]),
        "two-lists-in-a-list": [[opt], [sched]],
    }[form]


@pytest.mark.parametrize(
    "form",
    [
        "optimizer",
        "list",
        "dict",
        "dict-with-config",
        "dict-alone",
        "list-of-dicts",
        "two-lists",
        "two-lists-in-a-list",
    ],
)
def test_plain_checkpoint_takes_what_configure_optimizers_returns(form: str) -> None:
    checkpoint = isolated_checkpoint()
    model = Plain()
    value = configured(form, model)
    rewritten = plain_checkpoint(checkpoint, model, value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(rewritten["optimizer_states"][0])
    assert [len(g["params"]) for g in opt.param_groups] == [4]
    assert len(opt.state) == 4  # every momentum buffer, by name
    assert rewritten["lr_schedulers"][0]["base_lrs"] == [0.1]
    assert "IsolationCallback" not in rewritten["callbacks"]


def test_plain_checkpoint_refuses_what_holds_no_optimizer() -> None:
    checkpoint = isolated_checkpoint()
    model = Plain()
    with pytest.raises(IsolationTypeError, match=r"^plain_checkpoint\(\): optimizer must be"):
        plain_checkpoint(checkpoint, model, {"optimiser": None})
    with pytest.raises(CheckpointMismatchError, match=r"but 0 optimizers were given"):
        plain_checkpoint(checkpoint, model, None)
    opt = configured("optimizer", model)
    with pytest.raises(CheckpointMismatchError, match=r"but 2 optimizers were given"):
        plain_checkpoint(checkpoint, model, [opt, opt])
