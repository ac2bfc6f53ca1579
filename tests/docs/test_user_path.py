"""What a new user reads first: a README of a few minutes with the install line, a quickstart
that runs as written, the same in Lightning's YAML, the map from the peers, and links that
lead somewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from isolate import IsolationSpec
from tests._launch import REPO, child_env

README = REPO / "README.md"


def block_after(marker: str, language: str) -> tuple[int, str]:
    """The line number of ``<!-- marker -->`` and the ``language`` code block after it."""
    text = README.read_text()
    found = re.search(rf"<!-- {marker} -->\n```{language}\n(.*?)```", text, flags=re.S)
    assert found is not None, f"README.md has no <!-- {marker} --> {language} block"
    return text[: found.start()].count("\n") + 1, found.group(1)


def test_the_readme_reads_in_five_minutes() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < 250
    line, quickstart = block_after("quickstart", "python")
    assert line + quickstart.count("\n") < 60  # the whole quickstart within the first 60 lines
    assert len(quickstart.splitlines()) <= 20
    assert all(len(code) <= 100 for code in quickstart.splitlines())
    text = README.read_text()
    for part in ("## Install", "pip install 'torch-isolate[", "download.pytorch.org/whl/cpu"):
        assert part in text
    assert "Not `pip install isolate`" in text  # the other project with the same import name
    for extra in ("lightning", "peft", "plot"):
        assert re.search(rf"^{extra} = \[", (REPO / "pyproject.toml").read_text(), re.M), extra


def test_the_quickstart_copied_into_a_file_runs(tmp_path: Path) -> None:
    _, quickstart = block_after("quickstart", "python")
    (tmp_path / "quickstart.py").write_text(quickstart)
    done = subprocess.run(
        [sys.executable, "quickstart.py"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("verify ran 4 times; every check passed:\n")
    assert done.stdout.rstrip().endswith("('backbone.3',)")
    assert "reach (4x): the loss backpropagated reached each of 6 trainable parameters" in (
        done.stdout
    )


def _backbone_and_head() -> nn.Module:
    backbone = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32))
    return nn.Sequential(OrderedDict(backbone=backbone, head=nn.Linear(32, 2)))


@pytest.mark.slow
def test_the_lightning_yaml_does_what_the_quickstart_does(tmp_path: Path) -> None:
    import pytorch_lightning as pl

    from isolate.lightning import IsolationCallback

    _, text = block_after("lightning-yaml", "yaml")
    (callback,) = yaml.safe_load(text)["trainer"]["callbacks"]
    assert callback["class_path"] == "isolate.lightning.IsolationCallback"
    isolation = IsolationCallback(**callback["init_args"])

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = _backbone_and_head().backbone
            self.head = nn.Linear(32, 2)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            labels = (batch[:, 0] > 0.5).long()
            return nn.functional.cross_entropy(self.head(self.backbone(batch)), labels)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

        def train_dataloader(self) -> torch.utils.data.DataLoader[torch.Tensor]:
            return torch.utils.data.DataLoader(torch.randn(32, 8).abs(), batch_size=8)

    module = Module()
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=3,
        accelerator="cpu",
        callbacks=[isolation],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    moved = {n for n, p in module.named_parameters() if not torch.equal(p, start[n])}
    # The head and the norms train from the start, backbone.3 from epoch 2, the rest never.
    assert moved == {
        "backbone.1.weight",
        "backbone.1.bias",
        "backbone.3.weight",
        "backbone.3.bias",
        "head.weight",
        "head.bias",
    }
    assert len(trainer.optimizers[0].param_groups) == 2  # the thaw's group, added once
    assert trainer.optimizers[0].param_groups[1]["lr"] == 1.0e-3
    assert isolation.tally.times["drift"] > 0


@pytest.mark.parametrize(
    "freeze",
    [
        ["backbone", "!type:_BatchNorm"],  # BackboneFinetuning's train_bn=True
        ["*", "!head", "!type:*Norm*"],  # fastai's freeze_to(-1)
    ],
)
def test_the_peer_tables_selectors_select_what_they_say(freeze: list[str]) -> None:
    text = README.read_text()
    assert all(f'"{s}"' in text or f"{s}," in text or f"{s}]" in text for s in freeze)
    model = _backbone_and_head()
    with IsolationSpec(freeze=freeze).applied(model):
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["backbone.1.weight", "backbone.1.bias", "head.weight", "head.bias"]


def test_every_link_of_the_readme_and_the_docs_leads_to_a_file() -> None:
    pages = [README, *(REPO / "docs").rglob("*.md")]
    broken = []
    for page in pages:
        prose = re.sub(r"```.*?```|`[^`]*`", "", page.read_text(), flags=re.S)  # no code
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken
