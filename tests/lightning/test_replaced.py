"""A frozen layer that ``configure_model`` builds again, after the callback applied the spec at
``setup``, is refused at fit start by name, under each Lightning."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from isolate.errors import ReplacedParameterError
from isolate.lightning import IsolationCallback
from tests.lightning._models import loader, net, trainer

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")


def test_the_callback_refuses_a_frozen_layer_built_again_in_configure_model(
    pl: ModuleType, tmp_path: Path
) -> None:
    # Net(replace_bn=True) builds trunk.1 again in configure_model, after the callback's setup.
    model = net(pl)(replace_bn=True)
    callback = IsolationCallback(freeze=["trunk"], bn="train")
    with pytest.raises(ReplacedParameterError, match=r"at attach, the spec's parameters "):
        trainer(tmp_path, [callback], lightning=pl).fit(model, loader())
    assert all(p.requires_grad for p in model.parameters())  # restored
