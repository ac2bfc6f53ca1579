"""Which Lightning strategies the callback supports: an unknown one, DeepSpeed, and FSDP without
``use_orig_params`` are refused naming the reason; a DDP wrapper built by another strategy is
not rebuilt. (Runs under DDP and FSDP2 are in tests/distributed/.)"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)
from torch.nn.parallel import DistributedDataParallel

from isolate.errors import CheckpointMismatchError, SpecError, UnsupportedStrategyError
from isolate.lightning import IsolationCallback
from isolate.lightning.checkpoint import SavedState
from isolate.lightning.strategies import (
    applies_at_fit_start,
    check_trainer,
    load_state_first,
    rewrap,
)
from tests.lightning._models import Net


def _fake_trainer(strategy: object, callback: object) -> Any:
    return types.SimpleNamespace(callbacks=[callback], strategy=strategy)


def test_an_unsupported_strategy_is_refused_by_name() -> None:
    callback = IsolationCallback(freeze=["trunk"])

    class ShardingStrategy:
        pass

    fake = types.SimpleNamespace(callbacks=[callback], strategy=ShardingStrategy())
    with pytest.raises(SpecError, match=r"ShardingStrategy strategy is not supported"):
        check_trainer(fake, callback, "IsolationCallback")  # type: ignore[arg-type]


def test_deepspeed_is_refused_naming_the_reason() -> None:
    callback = IsolationCallback(freeze=["trunk"])
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # deepspeed is not installed
    with pytest.raises(
        UnsupportedStrategyError, match=r"^IsolationCallback: the DeepSpeedStrategy is not"
    ) as raised:
        check_trainer(_fake_trainer(strategy, callback), callback, "IsolationCallback")
    assert "microsoft/DeepSpeed#5639" in str(raised.value)
    assert "ModelParallelStrategy" in str(raised.value)


def test_fsdp_strategy_without_orig_params_is_refused() -> None:
    callback = IsolationCallback(freeze=["trunk"])
    strategy = FSDPStrategy.__new__(FSDPStrategy)
    strategy.kwargs = {"use_orig_params": False}
    with pytest.raises(UnsupportedStrategyError, match=r"use_orig_params=False\) flattens"):
        check_trainer(_fake_trainer(strategy, callback), callback, "IsolationCallback")
    strategy.kwargs = {"use_orig_params": True}
    check_trainer(_fake_trainer(strategy, callback), callback, "IsolationCallback")


def test_only_a_strategy_that_builds_the_model_in_configure_model_waits_for_fit_start() -> None:
    def waits(strategy: Any) -> bool:
        return applies_at_fit_start(types.SimpleNamespace(strategy=strategy))  # type: ignore[arg-type]

    assert waits(ModelParallelStrategy())
    assert not waits(DDPStrategy()) and not waits(FSDPStrategy())


def test_a_ddp_wrapper_from_another_strategy_cannot_be_rebuilt() -> None:
    wrapped = object.__new__(DistributedDataParallel)  # isinstance only: never run
    fake = types.SimpleNamespace(strategy=types.SimpleNamespace(model=wrapped))
    with pytest.raises(SpecError, match=r"wrapped in DistributedDataParallel by SimpleNamespace"):
        rewrap(fake, "IsolationCallback")  # type: ignore[arg-type]
    plain = types.SimpleNamespace(strategy=types.SimpleNamespace(model=Net()))
    assert rewrap(plain, "IsolationCallback") is False  # type: ignore[arg-type]


def test_rewrap_builds_ddp_again_around_the_lightning_module() -> None:
    strategy: Any = DDPStrategy.__new__(DDPStrategy)  # isinstance and attributes only
    strategy._model = object.__new__(DistributedDataParallel)
    strategy._lightning_module = Net()
    built: list[Any] = []
    strategy.configure_ddp = lambda: built.append(strategy.model)
    assert rewrap(types.SimpleNamespace(strategy=strategy), "IsolationCallback") is True  # type: ignore[arg-type]
    assert built == [strategy._lightning_module]


class _Strategy:
    def __init__(self) -> None:
        self.loaded: list[Any] = []

    def load_checkpoint(self, checkpoint_path: Any) -> str:
        self.loaded.append(checkpoint_path)
        return "weights"


def test_the_callbacks_state_is_loaded_before_the_strategys_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    torch.save({"callbacks": {"Isolation": {"thawed": ["trunk"]}}}, path)
    strategy, got = _Strategy(), []
    trainer: Any = types.SimpleNamespace(strategy=strategy)
    load_state_first(trainer, "Isolation", got.append, "IsolationCallback")
    assert strategy.load_checkpoint(path) == "weights"
    assert got == [{"thawed": ["trunk"]}] and strategy.loaded == [path]
    assert "load_checkpoint" not in strategy.__dict__  # once
    load_state_first(trainer, "Other", got.append, "IsolationCallback")
    with pytest.raises(
        CheckpointMismatchError,
        match=r"^IsolationCallback: the checkpoint '.*last\.ckpt' holds no IsolationCallback state",
    ):
        strategy.load_checkpoint(str(path))
    assert strategy.loaded == [path]


def test_a_fit_without_resume_takes_the_weights_check_off_the_strategy() -> None:
    strategy: Any = _Strategy()
    strategy.load_model_state_dict = lambda checkpoint: None  # as check_before_weights wraps it
    trainer: Any = types.SimpleNamespace(strategy=strategy)
    SavedState.no_resume(trainer)
    assert "load_model_state_dict" not in strategy.__dict__
    SavedState.no_resume(trainer)  # nothing to take off: a no-op
