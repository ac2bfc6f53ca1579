"""What ``what_trains`` reports of a small PEFT model, to the letter: each tensor's line, the
reasons a flagged tensor is idle, what goes against PEFT's intent both ways, the counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("peft")

from isolate.errors import IsolationTypeError
from isolate.peft import what_trains

pytestmark = pytest.mark.usefixtures("one_thread")

BIAS = "base_model.model.0.base_layer.bias"
A = "base_model.model.0.lora_A.default.weight"
B = "base_model.model.0.lora_B.default.weight"
SAVED = "base_model.model.2.modules_to_save.default"


def _model() -> nn.Module:
    """LoRA on module 0, module 2 saved whole; the base bias of 0 flagged and LoRA's B not,
    both against what PEFT means."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
    model.get_parameter(BIAS).requires_grad_(True)
    model.get_parameter(B).requires_grad_(False)
    return model


def test_the_report_names_every_flagged_tensor_and_counts_parameters() -> None:
    model = _model()
    held = [p for n, p in model.named_parameters() if p.requires_grad and n != f"{SAVED}.bias"]
    found = what_trains(model, model(torch.randn(3, 4)).sum(), torch.optim.AdamW(held))
    assert found.flagged == (BIAS, A, f"{SAVED}.weight", f"{SAVED}.bias")
    assert found.training == (BIAS, A, f"{SAVED}.weight")
    assert found.idle == {f"{SAVED}.bias": "in no optimizer"}
    adapter = "adapter 'default' (active)"
    assert found.wrong == {
        BIAS: "requires grad, but it is the base weight of base_model.model.0.base_layer",
        B: f"does not require grad, but it is the adapter tensor of {adapter}",
    }
    assert found.numel([A, f"{SAVED}.bias"]) == 8 + 2
    assert str(found).splitlines() == [
        f"  trains  {BIAS}: base weight of base_model.model.0.base_layer",
        f"  trains  {A}: adapter tensor of {adapter}",
        f"  trains  {SAVED}.weight: modules_to_save copy of {adapter}",
        f"  idle    {SAVED}.bias: modules_to_save copy of {adapter}; in no optimizer",
        f"  WRONG   {BIAS}: requires grad, but it is the base weight of "
        "base_model.model.0.base_layer",
        f"  WRONG   {B}: does not require grad, but it is the adapter tensor of {adapter}",
        "flagged trainable 22 of 56 parameters in 4 tensors (print_trainable_parameters "
        "counts these); really training 20 in 3 tensors; idle 1; against PEFT's intent 2",
    ]


def test_losses_by_name_and_no_optimizer() -> None:
    model = _model()
    out = model(torch.randn(3, 4))
    found = what_trains(model, {"first": out[:, 0].sum(), "second": out[:, 1].sum()})
    assert found.idle == {}  # no optimizer: not checked
    assert found.training == found.flagged
    rows = {r.name: r for r in found.ledger.rows}
    assert set(rows[A].reached_by) == {"first", "second"}
    assert found.summary_line().startswith("flagged trainable 22 of 56 parameters in 4 tensors")
    assert found.summary_line().endswith(
        "really training 22 in 4 tensors; idle 0; against PEFT's intent 2"
    )


def test_one_loss_is_named_loss_in_the_ledger() -> None:
    model = _model()
    found = what_trains(model, model(torch.randn(3, 4)).sum())
    rows = {r.name: r for r in found.ledger.rows}
    assert tuple(rows[A].reached_by) == ("loss",)
    assert not rows["base_model.model.0.base_layer.weight"].reached_by  # flag off: no edge


@pytest.mark.parametrize("loss", [None, [torch.zeros(())], "loss"])
def test_a_loss_that_is_neither_a_tensor_nor_a_mapping_is_refused_by_name(loss: object) -> None:
    with pytest.raises(IsolationTypeError) as raised:
        what_trains(_model(), loss)  # type: ignore[arg-type]
    assert str(raised.value) == (
        "what_trains(): loss must be the loss tensor of one step (graph alive) or a mapping "
        f"of names to loss tensors, got {type(loss).__name__}; pass e.g. "
        "what_trains(model, model(**batch).loss, optimizer)"
    )


def test_a_bad_mapping_or_optimizer_is_refused_in_what_trains_name() -> None:
    model = _model()
    with pytest.raises(IsolationTypeError, match=r"^what_trains\(\): losses must map names to"):
        what_trains(model, {"main": 1.0})  # type: ignore[dict-item]
    loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(IsolationTypeError, match=r"^what_trains\(\): "):
        what_trains(model, loss, "adam")
