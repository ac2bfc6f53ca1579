"""Which Lightning strategies the callback supports: an unknown one, DeepSpeed, and FSDP without
``use_orig_params`` are refused naming the reason; a DDP wrapper built by another strategy is
not rebuilt. (Runs under DDP and FSDP2 are in tests/distributed/.)"""

from __future__ import annotations

import pickle
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


def test_a_trainer_without_callbacks_is_checked_on_its_strategy_alone() -> None:
    callback = IsolationCallback(freeze=["trunk"])
    bare: Any = types.SimpleNamespace(strategy=DDPStrategy())  # no `callbacks` attribute
    check_trainer(bare, callback, "IsolationCallback")
    bare.strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    with pytest.raises(UnsupportedStrategyError, match=r"the DeepSpeedStrategy is not supported"):
        check_trainer(bare, callback, "IsolationCallback")


class _Recording:
    """A strategy whose own ``load_checkpoint`` records every argument it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> str:
        self.calls.append((checkpoint_path, args, kwargs))
        return "weights"


def test_a_distributed_checkpoint_is_read_from_its_metadata_file(tmp_path: Path) -> None:
    folder = tmp_path / "epoch=0.ckpt"  # Lightning's distributed checkpoint: a folder
    folder.mkdir()
    torch.save({"callbacks": {"Isolation": {"thawed": ["trunk"]}}}, folder / "meta.pt")
    strategy, got = _Recording(), []
    load_state_first(types.SimpleNamespace(strategy=strategy), "Isolation", got.append, "cb")  # type: ignore[arg-type]
    assert strategy.load_checkpoint(folder, "positional", weights_only=True) == "weights"
    assert got == [{"thawed": ["trunk"]}]
    # The strategy's own load gets the folder and every argument, as it was called.
    assert strategy.calls == [(folder, ("positional",), {"weights_only": True})]


def _saved_on_a_gpu(tensor: torch.Tensor, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Save a checkpoint whose tensor is tagged with the device ``cuda:0``, as a run on a GPU
    leaves ``ModelCheckpoint``'s best score; loading it needs ``map_location`` without one."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        state = {"Isolation": {"thawed": []}, "ModelCheckpoint": {"best_model_score": tensor}}
        torch.save({"callbacks": state}, path)


def test_the_saved_state_of_a_gpu_run_is_read_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpu.ckpt"
    _saved_on_a_gpu(torch.tensor(0.25), path, monkeypatch)
    if not torch.cuda.is_available():  # the checkpoint is what a GPU run writes
        with pytest.raises(RuntimeError, match=r"CUDA"):
            torch.load(path, weights_only=True)
    strategy, got = _Recording(), []
    load_state_first(types.SimpleNamespace(strategy=strategy), "Isolation", got.append, "cb")  # type: ignore[arg-type]
    assert strategy.load_checkpoint(path) == "weights"
    assert got == [{"thawed": []}] and strategy.calls == [(path, (), {})]


class _RunsCode:
    """An object whose unpickling calls a function: what ``weights_only`` refuses."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (print, ("unpickled",))


def test_a_checkpoint_whose_pickle_runs_code_is_refused_even_when_the_environment_allows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "code.ckpt"
    torch.save({"callbacks": {"Isolation": {"thawed": []}}, "hook": _RunsCode()}, path)
    # Makes every torch.load that does not say weights_only= unpickle anything.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    strategy, got = _Recording(), []
    load_state_first(types.SimpleNamespace(strategy=strategy), "Isolation", got.append, "cb")  # type: ignore[arg-type]
    with pytest.raises(pickle.UnpicklingError, match=r"Weights only load failed"):
        strategy.load_checkpoint(path)
    assert got == [] and strategy.calls == []


def test_a_wrapper_left_by_an_earlier_fit_does_not_break_the_next_load(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    torch.save({"callbacks": {"Isolation": {"thawed": ["trunk"]}}}, path)
    strategy, got = _Recording(), []
    trainer: Any = types.SimpleNamespace(strategy=strategy)
    load_state_first(trainer, "Isolation", got.append, "cb")  # a fit that stopped before loading
    load_state_first(trainer, "Isolation", got.append, "cb")  # the next fit
    assert strategy.load_checkpoint(path) == "weights"
    assert got == [{"thawed": ["trunk"]}] * 2 and strategy.calls == [(path, (), {})]
    assert "load_checkpoint" not in strategy.__dict__
