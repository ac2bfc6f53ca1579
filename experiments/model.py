"""The MNIST network of the experiments: a trunk, a main head and auxiliary branches.

:class:`IsolationNet` trains ``head(trunk(x))`` on the digit label (the *main loss*) plus, for
each configured :class:`Branch`, a small head on the same trunk features with a loss of its
own. How a branch is connected to the features (plainly, :class:`isolate.Detached`,
:class:`isolate.Cloned`, :class:`isolate.GradientScale`) decides whether its loss reaches the
trunk, which is what the suite (:mod:`experiments.suite`) measures.

Every run of the same seed builds the trunk and the head from the same numbers and draws the
same dropout masks, with or without branches: a branch is initialised under a forked RNG seeded
with its own seed, and its forward pass (dropout included) draws from a generator state of its
own. So a branch that is cut off from the trunk leaves the main run identical to the last bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import isolate
import isolate.errors

__all__ = ["Branch", "IsolationNet", "make_trunk"]

Connect = Literal["attached", "detached", "detached_copy", "cloned", "reversal"]
Target = Literal["digit", "ink"]

_CONNECTS = ("attached", "detached", "detached_copy", "cloned", "reversal")
_TARGETS = ("digit", "ink")


@dataclass(frozen=True)
class Branch:
    """One auxiliary branch: a linear head on the trunk's features with a loss of its own.

    Attributes:
        name: names the branch in metrics (``val/acc/<name>``), parameter names
            (``branches.<name>.*``) and error messages; a Python identifier.
        connect: how the branch sees the trunk's features:

            * ``"attached"``: plainly; its loss reaches the trunk (the negative control).
            * ``"detached"``: through ``isolate.Detached(branch)``; an in-place edit of the
              features raises :class:`isolate.errors.InplaceModificationError`.
            * ``"detached_copy"``: through ``isolate.Detached(branch, inplace="copy")``; the
              branch edits a private copy.
            * ``"cloned"``: through ``isolate.Cloned(branch)``; edits stay in the copy but the
              gradient flows back into the trunk.
            * ``"reversal"``: through ``isolate.GradientScale(alpha)``; the trunk receives
              ``alpha`` times the branch's gradient (``alpha < 0``: gradient reversal).
        target: ``"digit"`` (the label; with a detached branch this is a linear probe) or
            ``"ink"``: whether the image holds more ink than the average training digit (its
            mean normalised pixel is above 0), a nuisance attribute for gradient reversal.
        edits_input: start the branch with ``nn.ReLU(inplace=True)``, which edits the trunk's
            features in place (they are pre-activation, so the values really change).
        dropout: dropout on the branch's input, drawn from the branch's own generator.
        weight: factor of the branch's loss in the trained objective.
        alpha: the gradient factor of ``connect="reversal"``.
        seed: seeds the branch's initialisation and its random stream.
        detach_early: with ``connect="detached"`` (or ``"detached_copy"``), how many trunk
            layers too early the branch's ``Detached`` sits: ``0`` wraps the branch, at the
            trunk's output, as intended; ``k > 0`` wraps the trunk's ``k``-th layer from the
            end instead, which the main head reads through too. The branch then reads the
            features plainly and trains those ``k`` layers, and no loss reaches the trunk's
            layers before them: the mistake ``configs/detached_early.yaml`` shows.
    """

    name: str = "probe"
    connect: Connect = "detached"
    target: Target = "digit"
    edits_input: bool = False
    dropout: float = 0.0
    weight: float = 1.0
    alpha: float = -1.0
    seed: int = 1
    detach_early: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the field if the branch cannot be built."""
        where = f"Branch(name={self.name!r})"
        if not self.name.isidentifier():
            raise ValueError(f"{where}: name must be a Python identifier, e.g. 'probe'")
        if self.connect not in _CONNECTS:
            raise ValueError(
                f"{where}: connect={self.connect!r} is unknown; choose one of {list(_CONNECTS)}"
            )
        if self.target not in _TARGETS:
            raise ValueError(
                f"{where}: target={self.target!r} is unknown; choose one of {list(_TARGETS)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{where}: dropout={self.dropout} must be in [0, 1)")
        if not (math.isfinite(self.weight) and math.isfinite(self.alpha)):
            raise ValueError(
                f"{where}: weight={self.weight} and alpha={self.alpha} must be finite numbers"
            )
        if isinstance(self.detach_early, bool) or not isinstance(self.detach_early, int):
            raise ValueError(f"{where}: detach_early={self.detach_early!r} must be an integer")
        if self.detach_early < 0 or (
            self.detach_early and self.connect not in ("detached", "detached_copy")
        ):
            raise ValueError(
                f"{where}: detach_early={self.detach_early} needs connect='detached' or "
                f"'detached_copy' and a count of trunk layers >= 0; got connect={self.connect!r}"
            )

    @property
    def num_classes(self) -> int:
        return 10 if self.target == "digit" else 2


def make_trunk(channels: Sequence[int] = (16, 32), features: int = 64) -> nn.Sequential:
    """A small CNN for 1x28x28 images: conv-BN-ReLU-pool blocks, then a linear layer.

    Its output is pre-activation (no ReLU at the end), so an in-place ReLU changes it.

    >>> make_trunk((4, 8), 16)(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 16])
    """
    if len(channels) < 1 or any(c < 1 for c in channels):
        raise ValueError(f"make_trunk(): channels={list(channels)} must be positive, at least one")
    layers: list[nn.Module] = []
    side, previous = 28, 1
    for width in channels:
        layers += [
            nn.Conv2d(previous, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]
        side, previous = side // 2, width
    layers += [nn.Flatten(), nn.Linear(previous * side * side, features)]
    return nn.Sequential(*layers)


def _branch_module(spec: Branch, features: int) -> nn.Module:
    layers: list[nn.Module] = []
    if spec.edits_input:
        layers.append(nn.ReLU(inplace=True))
    if spec.dropout:
        layers.append(nn.Dropout(spec.dropout))
    layers.append(nn.Linear(features, spec.num_classes))
    net = nn.Sequential(*layers)
    if spec.connect == "attached" or spec.detach_early:  # its Detached sits in the trunk
        return net
    if spec.connect == "detached":
        return isolate.Detached(net, name=spec.name)
    if spec.connect == "detached_copy":
        return isolate.Detached(net, inplace="copy", name=spec.name)
    if spec.connect == "cloned":
        return isolate.Cloned(net)
    return nn.Sequential(isolate.GradientScale(spec.alpha), net)


def _misplace_detach(trunk: nn.Sequential, spec: Branch) -> None:
    """Wrap the trunk's ``spec.detach_early``-th layer from the end in the branch's Detached."""
    if not 1 <= spec.detach_early <= len(trunk):
        raise ValueError(
            f"Branch(name={spec.name!r}): detach_early={spec.detach_early} must be at most the "
            f"trunk's {len(trunk)} layers"
        )
    index = len(trunk) - spec.detach_early
    inplace = "copy" if spec.connect == "detached_copy" else "error"
    trunk[index] = isolate.Detached(trunk[index], inplace=inplace, name=spec.name)


def branch_target(spec: Branch, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The labels a branch is trained on: the digit, or whether the image has above-average ink."""
    if spec.target == "digit":
        return labels
    return (images.flatten(1).mean(dim=1) > 0).long()


class IsolationNet(pl.LightningModule):
    """A trunk, a main head and auxiliary branches, trained on the main loss plus the branches'.

    The trained objective is ``main_loss + sum(branch.weight * branch_loss)``. The main loss
    always has weight 1, so with every branch cut off from the trunk the trunk's gradient from
    the objective equals, bit for bit, the gradient of a run without branches.

    Args:
        branches: the auxiliary branches (see :class:`Branch`); none for the baseline.
        trunk_requires_grad: ``False`` is the naive freeze: ``trunk.requires_grad_(False)`` at
            setup and nothing else, so the trunk's BatchNorm running statistics keep moving
            (the negative control of ``configs/frozen_trunk.yaml``, which freezes with
            ``isolate.lightning.IsolationCallback(freeze=["trunk"])``).
        channels: conv widths of the trunk.
        features: width of the trunk's output.
        dropout: dropout in the main head, drawn from the global (seeded) generator.
        lr: Adam's learning rate.

    Attributes:
        losses: the losses of the latest training step, with their graphs: ``"main"`` and one
            entry per branch name. Callbacks audit them in ``on_before_backward``.
        isolation_losses: the same dict, for :class:`isolate.lightning.IsolationCallback`
            (which empties it after reading).

    Raises:
        ValueError: a branch is invalid, or two branches share a name.

    Note:
        Global-norm gradient clipping (``Trainer(gradient_clip_val=...)``) scales the trunk's
        gradient by a norm that includes the branches' gradients, so a detached branch still
        changes the trunk's update. Clip per group, or not at all, when isolation matters.

    >>> net = IsolationNet(branches=[Branch(name="probe", connect="detached")])
    >>> sorted(name for name, _ in net.named_children())
    ['branches', 'head', 'trunk']
    >>> net(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    """

    def __init__(
        self,
        branches: Sequence[Branch] = (),
        trunk_requires_grad: bool = True,
        channels: Sequence[int] = (16, 32),
        features: int = 64,
        dropout: float = 0.2,
        lr: float = 2e-3,
    ) -> None:
        super().__init__()
        # load_from_checkpoint passes back the plain dicts saved below.
        specs = tuple(Branch(**b) if isinstance(b, dict) else b for b in branches)
        for spec in specs:
            spec.check()
        names = [spec.name for spec in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"IsolationNet: branch names must be unique; repeated: {duplicates}")
        early = [spec.name for spec in specs if spec.detach_early]
        if len(early) > 1:
            raise ValueError(
                f"IsolationNet: one branch at most may set detach_early (it moves the branch's "
                f"Detached into the trunk); set by {early}"
            )
        # Hyperparameters are saved as plain types, so checkpoints load with weights_only=True.
        branches = [asdict(spec) for spec in specs]
        channels = list(channels)
        self.save_hyperparameters()
        branches = specs
        self.specs = {spec.name: spec for spec in branches}
        self.trunk_requires_grad = trunk_requires_grad
        self.lr = lr
        # The main network is built first from the global stream, as in a run without branches.
        self.trunk = make_trunk(channels, features)
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(dropout), nn.Linear(features, 10))
        for spec in branches:
            if spec.detach_early:
                _misplace_detach(self.trunk, spec)
        self.branches = nn.ModuleDict()
        self._branch_rng: dict[str, torch.Tensor] = {}
        for spec in branches:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.seed)
                self.branches[spec.name] = _branch_module(spec, features)
                self._branch_rng[spec.name] = torch.get_rng_state()
        self.losses: dict[str, torch.Tensor] = {}
        self.isolation_losses: dict[str, torch.Tensor] = {}
        self._trunk_flags: list[tuple[nn.Parameter, bool]] | None = None

    # -- the network ------------------------------------------------------------------------

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The main head's logits."""
        return self.head(self.trunk(images))

    @contextmanager
    def _own_stream(self, name: str) -> Iterator[None]:
        # The branch draws from its own generator state, and the global one is put back, so
        # its dropout never shifts the main head's masks. CPU only: on CUDA, dropout draws
        # from the device generator, which is not forked here.
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._branch_rng[name])
            yield
            self._branch_rng[name] = torch.get_rng_state()

    def _outputs(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.trunk(images)
        out = {"main": self.head(features)}
        for name, branch in self.branches.items():
            with self._own_stream(name):
                out[name] = branch(features)
        return out

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        images, labels = batch
        outputs = self._outputs(images)
        losses = {"main": F.cross_entropy(outputs["main"], labels)}
        targets = {"main": labels}
        for name, spec in self.specs.items():
            targets[name] = branch_target(spec, images, labels)
            losses[name] = F.cross_entropy(outputs[name], targets[name])
        total = losses["main"]
        for name, spec in self.specs.items():
            total = total + spec.weight * losses[name]
        # Training metrics per step and per epoch (``*_step``, ``*_epoch`` in the logger),
        # validation and test per epoch; epoch values are averaged over processes under DDP.
        on_step = stage == "train"
        log: dict[str, Any] = {
            "on_step": on_step,
            "on_epoch": True,
            "batch_size": len(labels),
            "sync_dist": True,
        }
        self.log(f"{stage}/loss", total, prog_bar=on_step, **log)
        for name, logits in outputs.items():
            accuracy = (logits.argmax(dim=1) == targets[name]).float().mean()
            self.log(f"{stage}/loss/{name}", losses[name], **log)
            self.log(f"{stage}/acc/{name}", accuracy, prog_bar=name == "main", **log)
        if stage == "train":
            self.losses = losses
            self.isolation_losses = dict(losses)
        return total

    # -- Lightning hooks --------------------------------------------------------------------

    def configure_model(self) -> None:
        """Shard the trunk, the head and each branch with FSDP2 under ``ModelParallelStrategy``.

        Without a device mesh (any other strategy) this does nothing. Each part is a unit of its
        own, so a frozen trunk is a unit apart from what trains; the root is sharded last and
        holds no parameter, because ``training_step`` calls the parts, never ``self(x)``, and
        a parameter left to the root would never be all-gathered for the forward.
        """
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self, FSDPModule):  # configure_model may run again (a second fit)
            return
        for module in (self.trunk, self.head, *self.branches.values(), self):
            fully_shard(module, mesh=mesh["data_parallel"])

    def on_fit_end(self) -> None:
        # A unit can stay unsharded after validation (no backward reshards it): its registered
        # parameters are then FSDP's temporaries, which the strategy's model.to() at the next
        # Trainer call (test) cannot swap. Resharding frees them and communicates nothing.
        for module in self.modules():
            reshard = getattr(module, "reshard", None)
            if callable(reshard) and self.device_mesh is not None:
                reshard()

    def setup(self, stage: str) -> None:
        # Before the optimizer is built and before DDP wraps the model, as a freeze must be.
        if stage == "fit" and not self.trunk_requires_grad and self._trunk_flags is None:
            self._trunk_flags = [(p, p.requires_grad) for p in self.trunk.parameters()]
            self.trunk.requires_grad_(False)

    def teardown(self, stage: str) -> None:
        if self._trunk_flags is not None:
            for p, flag in self._trunk_flags:
                p.requires_grad_(flag)
        self._trunk_flags = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The branches' own random streams, so a resumed run goes on drawing where it stopped.
        checkpoint["branch_rng"] = {k: v.clone() for k, v in self._branch_rng.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("branch_rng", {})
        self._branch_rng.update({k: v.clone() for k, v in saved.items() if k in self._branch_rng})

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        return self._step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        return self._step(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    # -- for reports ----------------------------------------------------------------------

    def chance(self, loader: DataLoader[tuple[torch.Tensor, ...]]) -> dict[str, float]:
        """The accuracy of always guessing the most frequent class, per output, on ``loader``."""
        counts: dict[str, torch.Tensor] = {}
        for images, labels in loader:
            targets = {"main": labels}
            for name, spec in self.specs.items():
                targets[name] = branch_target(spec, images, labels)
            for name, target in targets.items():
                hist = torch.bincount(target, minlength=10)
                counts[name] = counts[name] + hist if name in counts else hist
        return {
            f"acc/{name}": float(hist.max()) / max(float(hist.sum()), 1.0)
            for name, hist in counts.items()
        }
