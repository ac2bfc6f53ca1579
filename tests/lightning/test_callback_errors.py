"""Every refusal of IsolationCallback, each reached through a real (tiny) Trainer where it can
be, with its message and with the model left as it was.

Each test below fails if its check is removed.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from isolate import IsolationSpec, IsolationWarning, Thaw
from isolate.errors import CheckpointMismatchError, CutOffError, IsolationTypeError, SpecError
from isolate.lightning import IsolationCallback
from isolate.spec.state import plain
from tests.lightning._models import Net, TwoOptimizerNet, loader, state, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore::isolate.IsolationWarning"),
]


def unchanged(model: Net, before: dict[str, torch.Tensor]) -> None:
    after = state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.requires_grad for p in model.parameters())
    assert type(model.aux) is torch.nn.Sequential


def test_spec_and_keywords_are_one_or_the_other() -> None:
    with pytest.raises(
        SpecError,
        match=r"^IsolationCallback: give spec= or the spec's keywords \['freeze'\], not both",
    ):
        IsolationCallback(spec=IsolationSpec(freeze=["trunk"]), freeze=["head"])
    with pytest.raises(
        SpecError,
        match=r"spec must be an isolate.IsolationSpec, got dict; for a mapping use "
        r"IsolationSpec.from_dict",
    ):
        IsolationCallback(spec={"freeze": ["trunk"]})  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"drift must be 'fingerprint' or 'copy', got 'none'"):
        IsolationCallback(drift="none")  # type: ignore[arg-type]
    spec = IsolationSpec(freeze=["trunk"], detach=["aux"])
    assert IsolationCallback(spec=spec).spec is spec
    assert (
        repr(IsolationCallback(spec=spec)) == "IsolationCallback(freeze=['trunk'], detach=['aux'])"
    )


def test_two_callbacks_on_one_trainer_are_refused(tmp_path: Path) -> None:
    model = Net()
    before = state(model)
    # Lightning refuses two stateful callbacks with one state key when the Trainer is built;
    # one added afterwards reaches fit, and the callback refuses it itself.
    fit = trainer(tmp_path, [IsolationCallback(freeze=["trunk"])])
    fit.callbacks.append(IsolationCallback(detach=["aux"]))
    with pytest.raises(
        SpecError,
        match=r"^IsolationCallback: the Trainer has 2 IsolationCallbacks; their checkpoint states "
        r"would collide",
    ):
        fit.fit(model, loader())
    unchanged(model, before)


def test_isolation_losses_must_be_a_dict_of_tensors(tmp_path: Path) -> None:
    class BadLosses(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.isolation_losses = [loss]
            return loss

    model = BadLosses()
    with pytest.raises(
        IsolationTypeError,
        match=r"^IsolationCallback: BadLosses.isolation_losses must be a dict of loss name -> "
        r"loss tensor, got \[tensor",
    ):
        trainer(tmp_path, [IsolationCallback(detach=["aux"], verify_every_n_steps=1)]).fit(
            model, loader()
        )
    assert type(model.aux) is torch.nn.Sequential  # on_exception took the wrapper off


@pytest.mark.parametrize(
    ("shape", "shown"),
    [
        pytest.param("zero", r"tensor\(0\., grad_fn", id="a-lone-loss-that-is-zero"),
        pytest.param("per-sample", r"tensor\(\[", id="a-lone-loss-per-sample"),
    ],
)
def test_a_lone_loss_tensor_in_place_of_the_dict_is_refused_whatever_its_value(
    tmp_path: Path, shape: str, shown: str
) -> None:
    class LoneLoss(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, z = batch
            features = self.trunk(x)
            per_sample = F.mse_loss(self.aux(features).squeeze(-1), z, reduction="none")
            self.isolation_losses = per_sample.mean() * 0 if shape == "zero" else per_sample
            return F.cross_entropy(self.head(features), y) + per_sample.mean()

    model = LoneLoss()
    with pytest.raises(
        IsolationTypeError,
        match=r"^IsolationCallback: LoneLoss.isolation_losses must be a dict of loss name -> "
        r"loss tensor, got " + shown,
    ):
        trainer(tmp_path, [IsolationCallback(detach=["aux"], verify_every_n_steps=1)]).fit(
            model, loader()
        )
    assert type(model.aux) is torch.nn.Sequential  # on_exception took the wrapper off
    assert all(p.requires_grad for p in model.parameters())


def test_protect_names_a_loss_training_step_does_not_set(tmp_path: Path) -> None:
    callback = IsolationCallback(
        protect={"aux": ["trunk"], "decoder": ["trunk"]}, verify_every_n_steps=1
    )
    with pytest.raises(
        SpecError,
        match=r"protect names the losses \['decoder'\], but Net.training_step set "
        r"isolation_losses with \['aux'\]",
    ):
        trainer(tmp_path, [callback]).fit(Net(), loader())


def test_optimizer_state_for_frozen_parameters_is_refused(tmp_path: Path) -> None:
    class Stepped(Net):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            for p in self.parameters():
                p.grad = torch.ones_like(p)
            opt.step()  # momentum buffers for every parameter, frozen ones included
            opt.zero_grad()
            return opt

    model = Stepped()
    with pytest.raises(
        SpecError, match=r"already holds state for frozen parameters \['trunk.0.weight'"
    ):
        trainer(tmp_path, [IsolationCallback(freeze=["trunk"])]).fit(model, loader())
    assert all(p.requires_grad for p in model.parameters())


class OwnOptimizer(Net):
    """configure_optimizers returns none (Lightning steps a placeholder); training_step builds
    and steps its own optimizer, which Lightning never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.own: torch.optim.Optimizer | None = None

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if self.own is None:
            self.own = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
        loss = super().training_step(batch, batch_idx)
        self.own.zero_grad()
        self.manual_backward(loss)
        self.own.step()

    def configure_optimizers(self) -> None:
        return None


@pytest.mark.parametrize(
    "thaw",
    [Thaw("trunk", epoch=1, lr=0.05), Thaw("trunk", step=2, lr=0.05)],
    ids=["by-epoch", "by-step"],
)
def test_a_thaw_with_no_optimizer_from_configure_optimizers_is_refused_at_fit_start(
    tmp_path: Path, thaw: Thaw
) -> None:
    model = OwnOptimizer()
    before = state(model)
    callback = IsolationCallback(freeze=["trunk"], detach=["aux"], thaw=[thaw])
    with pytest.raises(
        SpecError,
        match=r"^IsolationCallback: thaw groups \['trunk'\] join an optimizer as they thaw, but "
        r"OwnOptimizer.configure_optimizers returned none \(Lightning steps a placeholder that "
        r"updates nothing\), so once thawed they would never learn; return the optimizer from "
        r"configure_optimizers \(under manual optimization, take it with self.optimizers\(\)\)$",
    ):
        trainer(tmp_path, [callback], limit_val_batches=0).fit(model, loader())
    unchanged(model, before)
    assert model.own is None  # refused before the first step


def test_without_an_optimizer_from_configure_optimizers_no_placeholder_counts_as_checked(
    tmp_path: Path,
) -> None:
    callback = IsolationCallback(freeze=["trunk"], verify_every_n_steps=1)
    fit = trainer(tmp_path, [callback], limit_val_batches=0, max_epochs=1)
    fit.fit(OwnOptimizer(), loader())
    assert [type(o).__name__ for o in fit.optimizers] == ["_MockOptimizer"]
    assert callback.tally.last["optimizers"].optimizers == 0  # was 1: the placeholder


def test_a_thaw_whose_parameters_sit_in_two_optimizers_must_say_which(tmp_path: Path) -> None:
    class Both(TwoOptimizerNet):
        def configure_optimizers(self) -> Any:
            return (
                torch.optim.SGD([*self.trunk[0].parameters(), *self.head.parameters()], lr=0.1),
                torch.optim.SGD([*self.trunk[3].parameters(), *self.aux.parameters()], lr=0.1),
            )

    model = Both()
    before = state(model)
    callback = IsolationCallback(freeze=["trunk"], thaw=[Thaw(["trunk.0", "trunk.3"], epoch=1)])
    with pytest.raises(
        SpecError,
        match=r"thaw group 'trunk.0\+trunk.3': its parameters sit in optimizers \[0, 1\]; "
        r"say which one receives them with optimizer_idx=",
    ):
        trainer(tmp_path, [callback]).fit(model, loader())
    unchanged(model, before)


def test_a_checkpoint_with_malformed_state_is_refused(tmp_path: Path) -> None:
    callback = IsolationCallback(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=0.1)])
    fit = trainer(tmp_path, [callback], max_epochs=2, enable_checkpointing=True)
    fit.fit(Net(), loader())
    path = tmp_path / "last.ckpt"
    fit.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    key = next(k for k in checkpoint["callbacks"] if k.startswith("IsolationCallback"))
    cases = {
        "thawed": (
            [{"name": "trunk.3", "epoch": "one", "global_step": 4}],
            r"'thawed' must be a list of",
        ),
        "frozen": (
            ["trunk.0.weight"],
            r"lists \['trunk.0.weight'\] as frozen, but its schedule leaves",
        ),
        "format": (2, r"has format 2, expected 1"),
    }
    for field, (value, match) in cases.items():
        broken = torch.load(path, weights_only=True)
        broken["callbacks"][key][field] = value
        torch.save(broken, tmp_path / f"{field}.ckpt")
        model = Net()
        again = IsolationCallback(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1, lr=0.1)])
        with pytest.raises(CheckpointMismatchError, match=match):
            trainer(tmp_path / field, [again], max_epochs=3).fit(
                model, loader(), ckpt_path=tmp_path / f"{field}.ckpt", weights_only=True
            )
        assert all(p.requires_grad for p in model.parameters()), field


def test_state_that_cannot_be_saved_is_refused_by_type() -> None:
    with pytest.raises(
        IsolationTypeError, match=r"^IsolationCallback: cannot save object .* expected plain str"
    ):
        plain({"lr": object()}, "IsolationCallback")
    assert plain({"lr": torch.tensor(0.5).item(), "names": ("a",)}, "x") == {
        "lr": 0.5,
        "names": ["a"],
    }


def test_manual_backward_twice_checks_the_second_loss_against_the_same_forward(
    tmp_path: Path,
) -> None:
    # Manual optimization with two backwards over one forward: the first backward must not
    # clear what the Detached wrapper recorded for the check of the second.
    class TwoBackwards(TwoOptimizerNet):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y, z = batch
            main_opt, aux_opt = self.optimizers()  # type: ignore[misc]
            features = self.trunk(x)
            aux = F.mse_loss(self.aux(features).squeeze(-1), z)  # the branch runs first
            main_opt.zero_grad()
            aux_opt.zero_grad()
            self.manual_backward(F.cross_entropy(self.head(features), y), retain_graph=True)
            self.isolation_losses = {"aux": aux}
            self.manual_backward(aux)
            main_opt.step()
            aux_opt.step()

    model = TwoBackwards()
    trainer(tmp_path, [IsolationCallback(detach=["aux"], verify_every_n_steps=1)]).fit(
        model, loader()
    )
    assert type(model.aux) is torch.nn.Sequential


def test_parameters_cut_off_from_the_loss_are_named(tmp_path: Path) -> None:
    # The aux branch is trainable but its loss is never added in: its parameters get no
    # gradient, and the callback names them.
    with pytest.raises(
        CutOffError,
        match=r"^IsolationCallback: at step 0, 4 of 12 trainable parameters get no gradient "
        r"from any loss:\n  aux.0.weight, aux.0.bias, aux.2.weight, aux.2.bias: ",
    ):
        trainer(tmp_path / "a", [IsolationCallback(verify_every_n_steps=1)]).fit(
            Net(aux=False), loader()
        )
    # Declared unused, it is not a violation; with the branch in the loss, nothing is cut off.
    callback = IsolationCallback(verify_every_n_steps=1, expected_unused=["aux"])
    trainer(tmp_path / "b", [callback]).fit(Net(aux=False), loader())
    trainer(tmp_path / "c", [IsolationCallback(verify_every_n_steps=1)]).fit(Net(), loader())


def test_a_thawed_group_the_forward_skips_is_caught_on_its_first_step(tmp_path: Path) -> None:
    class SkipsTrunk3(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            features = self.trunk[:3](x)  # trunk.3 never runs
            return F.cross_entropy(self.head(torch.nn.functional.pad(features, (0, 0))), y)

    callback = IsolationCallback(
        freeze=["trunk"],
        thaw=[Thaw("trunk.3", step=3, lr=0.1)],
        verify_every_n_steps=100,  # not a check step: the thaw itself triggers the check
        expected_unused=["aux"],
        on_violation="warn",
    )
    with pytest.warns(
        IsolationWarning,
        match=r"at step 3, 2 of \d+ trainable parameters .*\n  trunk.3.weight, trunk.3.bias",
    ):
        trainer(tmp_path, [callback]).fit(SkipsTrunk3(), loader())


def test_engine_verify_names_a_misplaced_detach() -> None:
    model = Net()
    handle = IsolationSpec(detach=["aux"]).apply(model)
    handle.step(epoch=0, step=0)
    x = torch.randn(4, 4)
    features = model.trunk(x)
    wrong = model.head(features.detach()).sum() + model.aux(features).sum()  # head cut off
    with pytest.raises(CutOffError, match=r"trunk.0.weight, trunk.0.bias, .*trunk.3.bias: "):
        handle.verify(total=wrong, checks=("reach",))
    right = model.head(features).sum() + model.aux(features).sum()
    assert handle.verify(total=right, checks=("reach",)).reach == 12
    handle.restore()


def test_a_checkpoint_without_the_callbacks_state_is_refused_at_either_hook(
    tmp_path: Path,
) -> None:
    callback = IsolationCallback(freeze=["trunk"])
    fit = trainer(tmp_path, [callback], max_epochs=1)
    fit.fit(Net(), loader())
    callback.handle = IsolationSpec(freeze=["trunk"]).apply(Net())  # as during a fit
    try:
        with pytest.raises(CheckpointMismatchError, match=r"holds no IsolationCallback state"):
            callback.on_load_checkpoint(fit, fit.lightning_module, {"callbacks": {}})
    finally:
        callback.handle.restore()
        callback.handle = None


def test_the_callback_logs_the_gradient_figure_to_loggers_that_take_figures(
    tmp_path: Path,
) -> None:
    from pytorch_lightning.loggers.logger import Logger

    class FigureLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.figures: list[tuple[str, Any, int]] = []
            self.experiment = types.SimpleNamespace(
                add_figure=lambda tag, fig, global_step: self.figures.append(
                    (tag, fig, global_step)
                )
            )

        name = "figures"
        version = 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: Any, step: Any = None) -> None:
            pass

    logger = FigureLogger()
    callback = IsolationCallback(detach=["aux"], verify_every_n_steps=3, log_figures=True)
    trainer(tmp_path, [callback], logger=logger).fit(Net(), loader())
    assert [(tag, step) for tag, _, step in logger.figures] == [
        ("isolation/gradients", 0),
        ("isolation/gradients", 3),
        ("isolation/gradients", 6),
    ]
    figure = logger.figures[0][1]
    assert figure.axes and "aux" in " ".join(
        t.get_text() for t in figure.axes[0].get_yticklabels() + figure.axes[0].get_xticklabels()
    )
    assert figure.axes[0].get_yticklabels()[-1].get_text() == "cut off"  # its last row


MONITOR = Thaw("trunk.3", monitor="val_loss", patience=1, lr=0.1)


class NoValidation(Net):
    validation_step = pl.LightningModule.validation_step  # as if Net defined none


@pytest.mark.parametrize(
    ("make", "options", "why"),
    [
        (Net, {"limit_val_batches": 0}, r"limit_val_batches=0"),
        (NoValidation, {}, r"NoValidation defines no validation_step"),
    ],
    ids=["limit_val_batches", "no_validation_step"],
)
def test_a_monitor_thaw_in_a_fit_without_validation_is_refused(
    tmp_path: Path, make: type[Net], options: dict[str, Any], why: str
) -> None:
    model = make()
    before = state(model)
    fit = trainer(tmp_path, [IsolationCallback(freeze=["trunk"], thaw=[MONITOR])], **options)
    with pytest.raises(
        SpecError,
        match=r"^IsolationCallback: thaw groups \['trunk.3'\] wait for \['val_loss'\] to stop "
        rf"improving, but this fit runs no validation \({why}\), so they would never thaw",
    ):
        fit.fit(model, loader(), loader())
    unchanged(model, before)


def test_a_monitor_thaw_that_never_saw_a_validation_run_is_reported(tmp_path: Path) -> None:
    model = Net()
    callback = IsolationCallback(freeze=["trunk"], thaw=[MONITOR])
    fit = trainer(tmp_path, [callback])
    with pytest.warns(
        IsolationWarning,
        match=r"thaw group 'trunk.3' waited for 'val_loss' to stop improving, but no "
        r"validation ran during this fit, so it never thawed; pass val_dataloaders",
    ):
        fit.fit(model, loader())  # no val_dataloaders
    assert callback.state_dict()["thawed"] == []  # it waited all along
    fit = trainer(tmp_path, [IsolationCallback(freeze=["trunk"], thaw=[MONITOR])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IsolationWarning)
        fit.fit(Net(), loader(), loader())  # validated every epoch: nothing to report
    assert not [w for w in caught if "no validation ran" in str(w.message)]
