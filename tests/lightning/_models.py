"""A tiny LightningModule and data for the Lightning tests (shared with the DDP script).

The model has a trunk with BatchNorm, a classification head and an auxiliary regression
branch fed by the trunk's features. ``training_step`` names the auxiliary loss in
``self.isolation_losses``, the convention :class:`isolate.lightning.IsolationCallback` reads.

For exact resume tests: :func:`resumable_loader` (a seeded order per epoch that a checkpoint
can continue mid-epoch) and :class:`RNGState` (Lightning does not checkpoint the global RNG).

The network is written once (:class:`Steps`) and made a LightningModule of either Lightning
by :func:`net`; ``Net``, ``BackboneNet`` and :func:`trainer` are ``pytorch_lightning``'s unless
given ``lightning.pytorch`` (``net(lightning.pytorch)``, ``trainer(..., lightning=...)``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset


class Steps:
    """trunk (Linear, BatchNorm, ReLU, Linear) -> head; trunk -> aux: the body of a
    LightningModule of either Lightning (see :func:`net`).

    Args:
        aux: add the auxiliary loss to the training loss.
        all_params: build the optimizer from every parameter, frozen ones included.
        bypass: call the aux branch through ``self.aux.module`` (skipping a wrapper).
        nudge: move ``trunk.0.weight`` by hand at every step (a drift the callback must see).
        scheduler: return a cosine LR schedule (stepped every epoch) with the optimizer.
        replace_bn: build a new trunk BatchNorm in ``configure_model`` (after callback setup,
            as ``sync_batchnorm=True`` does).
        dropout: dropout on the trunk's features in ``training_step`` (the global RNG).
    """

    def __init__(
        self,
        *,
        aux: bool = True,
        all_params: bool = False,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        bypass: bool = False,
        nudge: bool = False,
        scheduler: bool = False,
        replace_bn: bool = False,
        dropout: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.aux = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        self.use_aux, self.all_params, self.bypass, self.nudge = aux, all_params, bypass, nudge
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.scheduler, self.replace_bn = scheduler, replace_bn
        self.dropout = dropout  # functional: a Dropout child would change the module tree

    def configure_model(self) -> None:
        if self.replace_bn:
            self.trunk[1] = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, z = batch
        features = self.trunk(x)
        if self.dropout:
            features = F.dropout(features, self.dropout, self.training)
        loss = F.cross_entropy(self.head(features), y)
        if self.use_aux:
            branch = self.aux.module if self.bypass else self.aux
            aux_loss = F.mse_loss(branch(features).squeeze(-1), z)
            self.isolation_losses = {"aux": aux_loss}
            loss = loss + aux_loss
        if self.nudge:
            with torch.no_grad():
                self.trunk[0].weight.add_(1e-3)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if self.all_params or p.requires_grad]
        opt = torch.optim.SGD(
            params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        if not self.scheduler:
            return opt
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)]


class BackboneSteps(Steps):
    """The same network, with the ``backbone`` attribute Lightning's BackboneFinetuning needs."""

    @property
    def backbone(self) -> nn.Module:
        return self.trunk  # type: ignore[attr-defined, no-any-return]


@functools.cache
def net(lightning: ModuleType, steps: type[Steps] = Steps) -> type[Any]:
    """``steps`` as a LightningModule of ``lightning`` (``pytorch_lightning`` or
    ``lightning.pytorch``): ``Steps`` -> ``Net``, ``BackboneSteps`` -> ``BackboneNet``."""
    name = steps.__name__.removesuffix("Steps") + "Net"
    namespace = {"__module__": __name__, "__doc__": steps.__doc__}
    return type(name, (steps, lightning.LightningModule), namespace)


Net = net(pl)
BackboneNet = net(pl, BackboneSteps)


class TwoOptimizerNet(Net):
    """Manual optimization: head (and whatever requires grad in the trunk) in optimizer 0,
    the aux branch in optimizer 1, each stepped on its own loss."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y, z = batch
        main_opt, aux_opt = self.optimizers()  # type: ignore[misc]
        features = self.trunk(x)
        main = F.cross_entropy(self.head(features), y)
        aux = F.mse_loss(self.aux(features).squeeze(-1), z)
        self.isolation_losses = {"aux": aux}
        main_opt.zero_grad()
        aux_opt.zero_grad()
        self.manual_backward(main + aux)
        main_opt.step()
        aux_opt.step()

    def configure_optimizers(self) -> Any:
        main = [*self.trunk.parameters(), *self.head.parameters()]
        return (
            torch.optim.SGD([p for p in main if p.requires_grad], lr=self.lr),
            torch.optim.SGD(self.aux.parameters(), lr=self.lr),
        )


def loader(n: int = 64, batch_size: int = 16, seed: int = 123) -> DataLoader[Any]:
    """Random inputs, class labels and regression targets, in a fixed order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    z = torch.randn(n, generator=g)
    return DataLoader(TensorDataset(x, y, z), batch_size=batch_size, shuffle=False)


class EpochSampler(Sampler[int]):
    """A permutation drawn from ``seed + epoch`` alone, that can start part-way through.

    Lightning calls ``set_epoch`` before each epoch; ``position`` counts the indices handed
    out in the current epoch, so a checkpoint written after a batch says where to go on.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch = self.start = self.position = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # a new epoch starts from its beginning
            self.epoch, self.start = epoch, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=generator)
        start, self.start = self.start, 0
        self.position = start
        for i in order[start:].tolist():
            self.position += 1
            yield i


class ResumableLoader(DataLoader[Any]):
    """A DataLoader with ``state_dict`` / ``load_state_dict``: Lightning saves its state in the
    fit loop's checkpoint entry and loads it before the first batch of a resumed fit."""

    sampler: EpochSampler

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "position": self.sampler.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.epoch, self.sampler.start = state["epoch"], state["position"]


def resumable_loader(n: int = 64, batch_size: int = 16, seed: int = 123) -> ResumableLoader:
    """The data of :func:`loader`, shuffled anew each epoch, resumable after any batch.

    Its own ``generator`` keeps ``iter()`` off the global RNG: a DataLoader without one draws
    a worker seed from it at every ``iter()``, and a resumed fit calls ``iter()`` at a point
    where the uninterrupted one did not.
    """
    data = loader(n, batch_size, seed).dataset
    return ResumableLoader(
        data,
        batch_size=batch_size,
        sampler=EpochSampler(n, seed),
        generator=torch.Generator().manual_seed(seed),
    )


class RNGState(pl.Callback):
    """Checkpoints the global CPU RNG, which Lightning does not: without it a resumed run
    draws other dropout masks than the run it continues."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])


def trainer(
    root: Path, callbacks: list[pl.Callback], *, lightning: ModuleType = pl, **kwargs: Any
) -> pl.Trainer:
    """A small CPU Trainer of ``lightning`` that writes only below ``root``."""
    options: dict[str, Any] = {
        "default_root_dir": root,
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "callbacks": callbacks,
    }
    options.update(kwargs)
    return lightning.Trainer(**options)  # type: ignore[no-any-return]


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer, by state_dict key."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(
    root: Path, model: pl.LightningModule, callbacks: list[pl.Callback], **kw: Any
) -> pl.Trainer:
    """Fit ``model`` for 2 epochs without validation (``kw`` overrides) and return the trainer."""
    options: dict[str, Any] = {"limit_val_batches": 0, "max_epochs": 2}
    options.update(kw)
    run = trainer(root, callbacks, **options)
    run.fit(model)
    return run


class Four(BoringModel):
    """Lightning's BoringModel with four Linear layers; its optimizer takes what trains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(
            nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 2)
        )

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
