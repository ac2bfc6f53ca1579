"""The PEFT faults, each planted in a tiny random Llama with LoRA and caught with its cause
named, under every runner; the clean model raises nothing over 5 seeds.

A runner takes a PEFT model and a :class:`Fault`, derives the spec with
:func:`isolate.peft.spec_for` and trains a few steps with checks at every step: a plain loop
driven by the handle's ``Loop``, or a Lightning ``Trainer`` (each Lightning) with the
``IsolationCallback``. Another runner (transformers' Trainer) is one more entry in
``RUNNERS``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

from isolate.errors import AdapterStateError, ContractError, IsolationError
from isolate.peft import spec_for
from tests._llama import VOCAB, batch, lora_llama

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:No seed found"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]
STEPS = 3
ROWS = [3, 5, 17]
EMBED = "(model\\.)?base_model.model.model.embed_tokens.weight"
LORA_A = r"(model\.)?base_model.model.model.layers.0.self_attn.q_proj.lora_A"


def _loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**data).loss


def _data(seed: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        data = batch(seed=seed * 100 + step)
        data["input_ids"][:, : len(ROWS)] = torch.tensor(ROWS)  # the trainable rows are used
        out.append(data)
    return out


@dataclass(frozen=True)
class Fault:
    """A model to build, what goes wrong in it, and the error that must name it (``None``:
    clean, nothing may be raised)."""

    build: Callable[[int], nn.Module]
    error: type[IsolationError] | None = None
    match: str = ""
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] = field(default=_loss)


def _clean(seed: int) -> nn.Module:
    from peft import LoraConfig

    model = lora_llama(
        seed=seed,
        checkpointing=False,
        lora={"modules_to_save": ["lm_head"], "trainable_token_indices": ROWS},
    )
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    return model


def _wrong_adapter(seed: int) -> nn.Module:
    model = _clean(seed)
    for name, p in model.named_parameters():
        if ".other." in name:  # as a load that leaves the loaded adapter trainable does
            p.requires_grad_(True)
    return model


def _masked_embedding(seed: int) -> nn.Module:
    """The whole embedding trainable, its gradient masked to some rows: AdamW's decay still
    moves the others (tests/peft/test_spec.py shows it by brute force)."""
    model = lora_llama(seed=seed)
    weight = model.get_input_embeddings().weight
    weight.requires_grad_(True)
    mask = torch.zeros(VOCAB, 1)
    mask[ROWS] = 1.0
    weight.register_hook(lambda g: g * mask)
    return model


FAULTS = {
    "clean": Fault(_clean),
    "wrong_adapter_trainable": Fault(
        _wrong_adapter,
        AdapterStateError,
        r"adapter 'other' is not active \(active: \['default'\]\) but 4 of its tensors "
        r"require grad: \['" + LORA_A + ".other",
    ),
    "weight_decay_on_masked_embedding_rows": Fault(
        _masked_embedding,
        AdapterStateError,
        rf"1 base tensors require grad: \['{EMBED}'\].*trainable_token_indices \(a weight "
        r"decay cannot move the other rows",
    ),
    "tied_head_through_modules_to_save": Fault(
        lambda seed: lora_llama(seed=seed, tied=True, lora={"modules_to_save": ["lm_head"]}),
        AdapterStateError,
        rf"lm_head is trained through modules_to_save, but its original weight is tied to "
        rf"'{EMBED}'",
    ),
    "reentrant_checkpoint_without_input_grads": Fault(
        lambda seed: lora_llama(
            seed=seed, checkpointing=True, input_grads=False, lora={"modules_to_save": ["lm_head"]}
        ),
        ContractError,
        r"contract 'peft:default' \(trains\) breaks its clause 'reached by the loss': the loss "
        r"backpropagated does not reach \['" + LORA_A + ".default.weight'",
    ),
    "requires_grad_on_a_detached_loss": Fault(
        lambda seed: lora_llama(seed=seed),
        ContractError,
        r"'reached by the loss': the loss backpropagated does not reach "
        r"\['" + LORA_A + ".default.weight'",
        loss=lambda model, data: model(**data).loss.detach().requires_grad_(True),
    ),
}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, weight_decay=0.1)


def run_loop(model: nn.Module, fault: Fault, seed: int, tmp_path: Path) -> None:
    """A plain loop driven by ``handle.check_every(1)``."""
    handle = spec_for(model).apply(model)
    opt = _adamw(model.parameters())
    handle.attach(opt)
    loop = handle.check_every(1)
    try:
        for step, data in enumerate(_data(seed)):
            loop.begin_step(epoch=0, step=step)
            loss = fault.loss(model, data)
            loop.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.end_step()
        loop.finish()
    finally:
        handle.restore()


@functools.cache
def _module(lightning: ModuleType) -> type[Any]:
    class PeftNet(lightning.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, model: nn.Module, fault: Fault) -> None:
            super().__init__()
            self.model, self.fault = model, fault

        def training_step(self, data: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.fault.loss(self.model, data)  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _adamw(self.parameters())

    return PeftNet


def run_lightning(lightning: ModuleType) -> Callable[[nn.Module, Fault, int, Path], None]:
    def run(model: nn.Module, fault: Fault, seed: int, tmp_path: Path) -> None:
        from isolate.lightning import IsolationCallback
        from tests.lightning._models import trainer

        callback = IsolationCallback(
            spec=spec_for(model).prefixed("model"),
            verify_every_n_steps=1,
            log_grad_norms=False,
            ledger=False,
        )
        data = torch.utils.data.DataLoader(_data(seed), batch_size=None)
        fit = trainer(tmp_path, [callback], lightning=lightning, max_epochs=1, max_steps=STEPS)
        fit.fit(_module(lightning)(model, fault), data)

    return run


RUNNERS: dict[str, Callable[[], Callable[[nn.Module, Fault, int, Path], None]]] = {
    "loop": lambda: run_loop,
    "pytorch_lightning": lambda: run_lightning(pytest.importorskip("pytorch_lightning")),
    "lightning.pytorch": lambda: run_lightning(pytest.importorskip("lightning.pytorch")),
}


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "clean"])
def test_each_fault_is_caught_with_its_cause_named(runner: str, fault: str, tmp_path: Path) -> None:
    planted = FAULTS[fault]
    assert planted.error is not None
    with pytest.raises(planted.error, match=planted.match):
        RUNNERS[runner]()(planted.build(0), planted, 0, tmp_path)


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_clean_runs_raise_nothing_over_five_seeds(runner: str, tmp_path: Path) -> None:
    clean = FAULTS["clean"]
    for seed in range(5):
        model = clean.build(seed)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        RUNNERS[runner]()(model, clean, seed, tmp_path / str(seed))
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        expected = {n for n in before if n in spec_for(model).contracts[0].select}
        assert moved == expected, seed
