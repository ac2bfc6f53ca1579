"""What the callback checks before a fit changes anything, called directly where no Trainer
gets there: the caller's name put in place of the spec's, and a module that is no
LightningModule."""

from __future__ import annotations

import types

import pytest
from torch import nn

from isolate import IsolationSpec, Thaw
from isolate.errors import IsolationTypeError, SpecError
from isolate.lightning import IsolationCallback
from isolate.lightning.preflight import check_validation


def test_only_the_spec_name_that_leads_the_message_is_replaced() -> None:
    # The user's value is quoted as given, even where it reads like the spec's name.
    with pytest.raises(SpecError) as caught:
        IsolationCallback(bn="IsolationSpec:")  # type: ignore[arg-type]
    assert str(caught.value) == (
        "IsolationCallback: bn must be 'eval' or 'train', got 'IsolationSpec:'"
    )


def test_the_validation_check_refuses_a_module_that_is_no_lightning_module() -> None:
    spec = IsolationSpec(freeze=["0"], thaw=[Thaw("0", monitor="val_loss", patience=1)])
    fit = types.SimpleNamespace(limit_val_batches=1.0)
    with pytest.raises(
        IsolationTypeError, match=r"^Caller: expected a LightningModule, got Sequential$"
    ):
        check_validation(fit, nn.Sequential(nn.Linear(2, 2)), spec, "Caller")  # type: ignore[arg-type]
