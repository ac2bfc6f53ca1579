"""SimSiam (Chen & He, 2021, "Exploring Simple Siamese Representation Learning") on MNIST.

Two augmented views of each image go through the same encoder and projector (``z``) and a
predictor (``p``); the loss is the negative cosine similarity of ``p`` of one view with ``z``
of the other, symmetrised. The paper's central ablation: with ``stop_gradient`` on ``z``
training works; without it the representation collapses to a constant, which shows as the
per-channel standard deviation of the l2-normalised output ``z / ||z||`` falling to 0 (it stays
near ``1 / sqrt(dim)`` when the output spreads over the unit sphere).

:class:`SimSiam` logs that standard deviation every step (``train/z_std``) and, at every
validation, the accuracy of a k-nearest-neighbour classifier on the encoder's features with
the training images as the memory bank (``val/knn_acc``), the paper's monitor; ``trainer.test``
measures the same on the test split (``test/knn_acc``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

import isolate
from experiments.model import make_trunk

__all__ = ["SimSiam", "augment", "normalized_std"]


def augment(
    images: torch.Tensor, *, max_shift: float = 0.15, max_turn: float = 0.35
) -> torch.Tensor:
    """A random affine view of each image (scale, rotation, shift) plus pixel noise.

    Drawn from the global generator, so a seeded run sees the same views.

    >>> augment(torch.zeros(3, 1, 28, 28)).shape
    torch.Size([3, 1, 28, 28])
    """
    n = images.shape[0]
    scale = torch.empty(n).uniform_(0.75, 1.15)
    turn = torch.empty(n).uniform_(-max_turn, max_turn)
    shift = torch.empty(n, 2).uniform_(-max_shift, max_shift)
    cos, sin = torch.cos(turn) / scale, torch.sin(turn) / scale
    theta = torch.stack(
        [torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1
    ).to(images)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    # Outside the image is background: the lowest value of the normalised images.
    floor = images.amin()
    views = F.grid_sample(images - floor, grid, align_corners=False) + floor
    return views + 0.2 * torch.randn_like(views)


def normalized_std(z: torch.Tensor) -> torch.Tensor:
    """Mean over channels of the std over the batch of ``z / ||z||`` (the paper's collapse gauge).

    >>> round(float(normalized_std(torch.ones(8, 4))), 6)
    0.0
    """
    return F.normalize(z.detach(), dim=1).std(dim=0).mean()


class SimSiam(pl.LightningModule):
    """SimSiam with a small CNN encoder, with or without the stop-gradient.

    Args:
        stop_gradient: apply :func:`isolate.stop_gradient` to the projector's output ``z``
            before it is compared with the other view's prediction (the paper's method);
            ``False`` is the ablation that collapses.
        channels: conv widths of the encoder (the same trunk as :class:`IsolationNet`).
        features: width of the encoder's output.
        dim: width of the projector's output ``z``.
        pred_hidden: the predictor's bottleneck width.
        lr: SGD learning rate (momentum 0.9, as in the paper).
        weight_decay: SGD weight decay.
        knn_k: neighbours of the kNN monitor.
        knn_bank: how many training images form the kNN monitor's memory bank (the first of
            the datamodule's shuffled training split; the encoder embeds them at every
            validation, which is the monitor's main cost).

    >>> model = SimSiam(dim=32)
    >>> model.projector(model.encoder(torch.zeros(2, 1, 28, 28))).shape
    torch.Size([2, 32])
    """

    def __init__(
        self,
        stop_gradient: bool = True,
        channels: Sequence[int] = (16, 32),
        features: int = 64,
        dim: int = 64,
        pred_hidden: int = 16,
        lr: float = 0.1,
        weight_decay: float = 1e-4,
        knn_k: int = 20,
        knn_bank: int = 2000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stop_gradient = stop_gradient
        self.encoder = make_trunk(channels, features)
        self.projector = nn.Sequential(
            nn.BatchNorm1d(features),
            nn.ReLU(),
            nn.Linear(features, dim, bias=False),
            nn.BatchNorm1d(dim),
            nn.ReLU(),
            nn.Linear(dim, dim),
        )
        self.predictor = nn.Sequential(
            nn.Linear(dim, pred_hidden, bias=False),
            nn.BatchNorm1d(pred_hidden),
            nn.ReLU(),
            nn.Linear(pred_hidden, dim),
        )
        self.lr = lr
        self.weight_decay = weight_decay
        self.knn_k = knn_k
        self.knn_bank = knn_bank
        self._val_features: list[torch.Tensor] = []
        self._val_labels: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The encoder's features (what the kNN monitor classifies)."""
        return self.encoder(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        images, _ = batch
        z1 = self.projector(self.encoder(augment(images)))
        z2 = self.projector(self.encoder(augment(images)))
        p1, p2 = self.predictor(z1), self.predictor(z2)
        t1, t2 = isolate.stop_gradient((z1, z2)) if self.stop_gradient else (z1, z2)
        loss = -(F.cosine_similarity(p1, t2).mean() + F.cosine_similarity(p2, t1).mean()) / 2
        self.isolation_losses = {"simsiam": loss}  # for the stop_gradient contract
        std = normalized_std(z1)
        # Per step and per epoch (``*_step``, ``*_epoch`` in the logger).
        log: dict[str, Any] = {"on_step": True, "on_epoch": True, "sync_dist": True}
        self.log("train/loss", loss, prog_bar=True, **log)
        self.log("train/z_std", std, prog_bar=True, **log)
        self.log("train/z_std_ref", 1 / math.sqrt(z1.shape[1]), **log)
        return loss

    # -- the kNN monitor --------------------------------------------------------------------

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self._val_features.append(self.encoder(images))
        self._val_labels.append(labels)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self._log_knn("val")

    def on_test_epoch_end(self) -> None:
        self._log_knn("test")

    def _log_knn(self, stage: str) -> None:
        if not self._val_features:
            return
        features, labels = torch.cat(self._val_features), torch.cat(self._val_labels)
        self._val_features, self._val_labels = [], []
        bank = self._bank()
        if bank is None:
            return
        accuracy = self._knn(features, labels, *bank)
        self.log(f"{stage}/knn_acc", accuracy, prog_bar=True, sync_dist=True)

    def _bank(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer else None
        train_set = getattr(datamodule, "train_set", None)
        if train_set is None:
            return None
        images, labels = (t[: self.knn_bank] for t in train_set.tensors)
        with torch.no_grad():
            feats = torch.cat([self.encoder(chunk.to(self.device)) for chunk in images.split(1000)])
        return feats, labels.to(self.device)

    def _knn(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        bank: torch.Tensor,
        bank_labels: torch.Tensor,
    ) -> float:
        similarity = F.normalize(features, dim=1) @ F.normalize(bank, dim=1).T
        k = min(self.knn_k, bank.shape[0])
        top, idx = similarity.topk(k, dim=1)
        votes = torch.zeros(len(features), 10, device=features.device)
        votes.scatter_add_(1, bank_labels[idx], (top / 0.1).exp())
        return float((votes.argmax(dim=1) == labels).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.parameters(), lr=self.lr, momentum=0.9, weight_decay=self.weight_decay
        )
