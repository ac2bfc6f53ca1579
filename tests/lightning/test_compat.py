"""The Callback base class built from every Lightning installed, and the package an object
comes from, with one or both Lightnings installed or imported."""

from __future__ import annotations

import importlib
import sys
import types
from types import ModuleType
from typing import Any

import lightning.pytorch
import pytest
import pytorch_lightning
import torch

compat = importlib.import_module("isolate.lightning._compat")


def _only(*names: str) -> Any:
    """``importlib`` for ``_compat`` with only the Lightnings ``names`` installed."""

    def import_module(name: str) -> ModuleType:
        if name not in names:
            top = name.split(".")[0]
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)
        return importlib.import_module(name)

    return types.SimpleNamespace(import_module=import_module)


def test_with_both_lightnings_the_callback_derives_from_both() -> None:
    built = compat._callback()
    assert built.__mro__[1:] == (
        pytorch_lightning.Callback,
        lightning.pytorch.Callback,
        object,
    )
    assert built.__name__ == "Callback"
    assert built.__module__ == "isolate.lightning._compat"
    assert built.__doc__ == "A Callback of pytorch_lightning and of lightning.pytorch."


@pytest.mark.parametrize("name", ["pytorch_lightning", "lightning.pytorch"])
def test_with_one_lightning_the_callback_is_its_own(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "importlib", _only(name))
    assert compat._callback() is importlib.import_module(name).Callback


def test_without_lightning_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "importlib", _only())
    with pytest.raises(ModuleNotFoundError) as missing:
        compat._installed()
    assert str(missing.value) == (
        "isolate.lightning needs Lightning, an optional dependency: pip install "
        "'isolate[lightning]' (pytorch-lightning), or pip install lightning"
    )


def test_an_object_of_the_unified_lightning_is_found_when_the_standalone_is_not_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "pytorch_lightning")  # as if never imported
    strategy = lightning.pytorch.strategies.SingleDeviceStrategy(torch.device("cpu"))
    assert compat.package(strategy, "strategies.Strategy") is lightning.pytorch
    assert compat.package(object(), "strategies.Strategy") is None
