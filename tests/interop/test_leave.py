"""Leaving isolate: the weights of a run under IsolationCallback load into a plain model, and
the optimizer state resumes without the callback once ``plain_checkpoint`` has rewritten it to
the plain layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from isolate import Thaw
from isolate.interop.leave import plain_checkpoint
from isolate.lightning import IsolationCallback
from tests.lightning._models import Four, fit, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:.*Found .* module.* in eval mode"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),
]


class Plain(Four):
    """The same LightningModule run without isolate: every parameter trains from the start."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Isolated(Plain):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(
            [p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9
        )


def test_leaving_isolate_weights_and_resume_without_the_callback(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    callback = IsolationCallback(
        freeze=["layer.0", "layer.1"],
        clone=["layer.3"],  # a wrapper: state_dict keys stay as they were
        thaw=[Thaw("layer.0", epoch=1, lr=0.01)],
    )
    kw = {"limit_train_batches": 2, "limit_val_batches": 0, "enable_checkpointing": True}
    fit(tmp_path, Isolated(), [callback, checkpoint], **kw)
    saved = torch.load(checkpoint.last_model_path, weights_only=True)

    # 1. Weights only: into a plain model, strictly.
    plain = Plain()
    plain.load_state_dict(saved["state_dict"])
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in saved["state_dict"].items())

    # 2. Resume without the callback: torch refuses the isolate layout as it is ...
    with pytest.raises(ValueError, match="different number of parameter groups"):
        trainer(tmp_path / "as-is", [], max_epochs=3, **kw).fit(
            Plain(), ckpt_path=checkpoint.last_model_path
        )

    # ... and takes the rewritten one: every momentum buffer lands on its parameter by name.
    model = Plain()
    rewritten = plain_checkpoint(saved, model, model.configure_optimizers())
    assert "IsolationCallback" not in rewritten["callbacks"]
    path = tmp_path / "plain.ckpt"
    torch.save(rewritten, path)
    names = {id(p): n for n, p in model.named_parameters()}
    saved_state = saved["optimizer_states"][0]
    layout = saved["callbacks"]["IsolationCallback"]["layout"][0]
    by_name = {
        name: saved_state["state"][i]["momentum_buffer"]
        for group, names_ in zip(saved_state["param_groups"], layout, strict=True)
        for i, name in zip(group["params"], names_, strict=True)
        if i in saved_state["state"]
    }
    seen: dict[str, torch.Tensor] = {}

    class Look(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            opt = trainer.optimizers[0]
            for p, s in opt.state.items():
                seen[names[id(p)]] = s["momentum_buffer"].clone()

    run = trainer(tmp_path / "plain", [Look()], max_epochs=3, **kw)
    run.fit(model, ckpt_path=path)
    assert run.current_epoch == 3
    assert [len(g["params"]) for g in run.optimizers[0].param_groups] == [8]
    assert (
        set(seen)
        == set(by_name)
        == {n for n, _ in model.named_parameters() if n != "layer.1.weight" and n != "layer.1.bias"}
    )
    assert all(torch.equal(seen[n], by_name[n]) for n in by_name)
