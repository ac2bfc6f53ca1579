"""The named losses ``training_step`` leaves in ``self.isolation_losses``: each is read once
(a step that names none is not checked against the last step's), the attribute is left an
empty dict (``training_step`` may fill it by key), and only a dict of name -> tensor passes.

Net (tests.lightning._models) makes 4 optimizer steps per epoch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from isolate.errors import IsolationTypeError, SpecError
from isolate.lightning import IsolationCallback
from isolate.lightning.losses import check_named
from tests.lightning._models import Net, loader, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]


@pytest.mark.parametrize(
    "losses",
    [{"aux": 0.5}, {0: torch.tensor(0.5)}],
    ids=["value_not_a_tensor", "name_not_a_string"],
)
def test_named_losses_need_a_string_name_and_a_tensor_each(losses: dict[Any, Any]) -> None:
    with pytest.raises(
        IsolationTypeError,
        match=r"^Caller: Net.isolation_losses must be a dict of loss name -> loss tensor, got ",
    ):
        check_named(Net(), losses, None, "Caller")


class FirstStepOnly(Net):
    """Names its aux loss on the first training step only."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step > 0:
            del self.isolation_losses
        return loss


def test_a_step_that_names_no_loss_is_not_checked_against_the_last_steps(
    tmp_path: Path,
) -> None:
    callback = IsolationCallback(detach=["aux"], protect={"aux": ["trunk"]}, verify_every_n_steps=1)
    with pytest.raises(
        SpecError,
        match=r"^IsolationCallback: protect names the losses \['aux'\], but FirstStepOnly."
        r"training_step did not set self.isolation_losses at step 1",
    ):
        trainer(tmp_path, [callback], max_epochs=1).fit(FirstStepOnly(), loader())
    assert callback.tally.times["losses"] == 1  # step 0's, read once


class FilledByKey(Net):
    """Keeps one dict of named losses and fills it by key at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.isolation_losses: dict[str, torch.Tensor] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, z = batch
        features = self.trunk(x)
        aux = F.mse_loss(self.aux(features).squeeze(-1), z)
        self.isolation_losses["aux"] = aux
        return F.cross_entropy(self.head(features), y) + aux


def test_the_losses_are_left_an_empty_dict_that_training_step_may_fill_by_key(
    tmp_path: Path,
) -> None:
    model = FilledByKey()
    callback = IsolationCallback(detach=["aux"], protect={"aux": ["trunk"]}, verify_every_n_steps=1)
    trainer(tmp_path, [callback], max_epochs=1).fit(model, loader())
    assert callback.tally.times["losses"] == 4  # every step's, each read once
    assert model.isolation_losses == {}
