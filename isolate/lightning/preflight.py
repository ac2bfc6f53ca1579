"""What the callback checks before a fit changes anything: the spec it was given (or its
keywords), and that a fit with ``monitor`` thaws validates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from isolate.errors import IsolationTypeError, SpecError
from isolate.lightning._compat import package
from isolate.spec import IsolationSpec

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["check_validation", "monitors", "optimizers_of", "spec_of"]


def spec_of(spec: object, keywords: dict[str, Any], caller: str) -> IsolationSpec:
    """``spec``, or the spec its ``keywords`` build (errors name ``caller``).

    Raises:
        SpecError: ``spec`` is no ``IsolationSpec``, both are given, or the keywords do not
            make a spec.
    """
    if spec is not None:
        if not isinstance(spec, IsolationSpec):
            raise SpecError(
                f"{caller}: spec must be an isolate.IsolationSpec, got {type(spec).__name__}"
                f"; for a mapping use IsolationSpec.from_dict(...)"
            )
        if keywords:
            raise SpecError(
                f"{caller}: give spec= or the spec's keywords {sorted(keywords)}, not both"
            )
        return spec
    try:
        return IsolationSpec(**keywords)
    except SpecError as error:  # name what the user called
        message = str(error).replace("IsolationSpec:", f"{caller}:", 1)
        raise SpecError(message) from None


def monitors(spec: IsolationSpec) -> bool:
    """Whether a thaw of ``spec`` waits for a metric (it needs validation runs)."""
    return any(t.monitor is not None for t in spec.thaw)


def check_validation(
    trainer: pl.Trainer, pl_module: pl.LightningModule, spec: IsolationSpec, caller: str
) -> None:
    """Refuse ``monitor`` thaws in a fit that cannot validate: they would never thaw.

    Raises:
        SpecError: ``limit_val_batches=0``, or the module defines no ``validation_step``.
    """
    watching = {str(t.name): str(t.monitor) for t in spec.thaw if t.monitor is not None}
    if not watching:
        return
    if trainer.limit_val_batches == 0:
        why = "limit_val_batches=0"
    elif not _overrides(pl_module, "validation_step", caller):
        why = f"{type(pl_module).__name__} defines no validation_step"
    else:
        return
    raise SpecError(
        f"{caller}: thaw groups {sorted(watching)} wait for {sorted(set(watching.values()))} "
        f"to stop improving, but this fit runs no validation ({why}), so they would never "
        f"thaw; log the metric in a validation_step and validate, or give them epoch= or step="
    )


def optimizers_of(
    trainer: pl.Trainer, pl_module: pl.LightningModule, spec: IsolationSpec, caller: str
) -> list[torch.optim.Optimizer]:
    """The trainer's optimizers, without the placeholder Lightning steps when
    ``configure_optimizers`` returns none (it holds no parameter and updates nothing: checked
    or thawed into, it would prove nothing and train nothing).

    Raises:
        SpecError: the spec thaws groups, but ``configure_optimizers`` returned no optimizer.
    """
    found = [o for o in trainer.optimizers if package(o, "core.optimizer._MockOptimizer") is None]
    if spec.thaw and not found:
        raise SpecError(
            f"{caller}: thaw groups {[str(t.name) for t in spec.thaw]} join an optimizer as "
            f"they thaw, but {type(pl_module).__name__}.configure_optimizers returned none "
            f"(Lightning steps a placeholder that updates nothing), so once thawed they would "
            f"never learn; return the optimizer from configure_optimizers (under manual "
            f"optimization, take it with self.optimizers())"
        )
    return found


def _overrides(pl_module: pl.LightningModule, hook: str, caller: str) -> bool:
    lightning = package(pl_module, "LightningModule")
    if lightning is None:
        raise IsolationTypeError(
            f"{caller}: expected a LightningModule, got {type(pl_module).__qualname__}"
        )
    return bool(lightning.utilities.model_helpers.is_overridden(hook, pl_module))
