"""The PEFT faults, each planted in a tiny random Llama with LoRA and caught with its cause
named, under every runner; the clean model raises nothing over 5 seeds.

A runner takes a model and a :class:`Fault`, derives the spec (by default with
:func:`isolate.peft.spec_for`) and trains a few steps with checks at every step: a plain loop
driven by the handle's ``Loop``, a Lightning ``Trainer`` (each Lightning) with the
``IsolationCallback``, or transformers' ``Trainer`` with the ``IsolationTrainerCallback``.
A fault that needs its own optimizer or loss plants it each runner's own way: the loop and
``configure_optimizers`` build it, a ``Trainer`` subclass overrides ``create_optimizer`` and
``compute_loss`` (where the Trainer builds its optimizer and takes its loss).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers.modeling_outputs import CausalLMOutput

from isolate.errors import (
    AdapterStateError,
    ContractError,
    ReplacedParameterError,
    SpecError,
)
from isolate.peft import spec_for
from isolate.spec import IsolationSpec
from tests._llama import VOCAB, lora_llama, tiny_llama
from tests.peft._matrix import ROWS, RUNNERS, Fault, adamw

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:No seed found"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]
EMBED = "(model\\.)?base_model.model.model.embed_tokens.weight"
LORA_A = r"(model\.)?base_model.model.model.layers.0.self_attn.q_proj.lora_A"
DOWN = "base_model.model.model.layers.0.mlp.down_proj"
TEACHER = r"(model\.)?teacher\.model\.embed_tokens\.weight"
MLP = "base_model.model.model.layers.0.mlp"
LORA_DROPOUT = "base_model.model.model.layers.0.self_attn.q_proj.lora_dropout.default"


def _clean(seed: int, **kw: object) -> nn.Module:
    from peft import LoraConfig

    model = lora_llama(
        seed=seed, lora={"modules_to_save": ["lm_head"], "trainable_token_indices": ROWS}, **kw
    )
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    return model


class Seen(nn.Dropout):
    """A dropout that records the mode of each of its forwards."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(p)
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return super().forward(x)


def _base_dropout(seed: int, *, attention: float = 0.0) -> nn.Module:
    """A dropout inside the frozen base's ``act_fn`` (a layer without tensors), LoRA with its
    own dropout, and the attention dropout of the layers LoRA adapts set to ``attention``."""
    model = lora_llama(seed=seed, lora={"lora_dropout": 0.1})
    mlp = model.get_submodule(MLP)
    mlp.act_fn = nn.Sequential(mlp.act_fn, Seen())
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = attention
    return model


def _held_in_eval_lora_dropout_in_train(model: nn.Module) -> None:
    """The base's dropout ran in eval mode at every forward, LoRA's in train mode."""
    seen = model.get_submodule(MLP + ".act_fn.1").modes
    assert seen and not any(seen), seen
    lora = model.get_submodule(LORA_DROPOUT)
    assert isinstance(lora, nn.Dropout) and lora.training


def _train_again(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss after ``model.train()``, as a user's loop may call it after the spec applied."""
    return model.train()(**data).loss  # type: ignore[no-any-return]


def _reentrant(seed: int) -> nn.Module:
    """transformers' reentrant gradient checkpointing, with the hook that makes the
    embeddings' output require grad (``enable_input_require_grads``): LoRA is reached."""
    return _clean(seed, checkpointing=True, input_grads=True)


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


def _reregistered(model: nn.Module) -> torch.optim.Optimizer:
    """A base weight registered again as a new ``nn.Parameter`` after the spec was applied
    (as a float8 or tensor-parallel conversion does): it requires grad, so the optimizer
    built next takes it."""
    layer = model.get_submodule(DOWN)
    layer.weight = nn.Parameter(layer.weight.detach().clone())
    return adamw(model.parameters())


class Distill(nn.Module):
    """A LoRA student learning from the output distribution of a teacher frozen by hand
    (``requires_grad_(False)``; ``in_eval``: put in eval mode too, which transformers' Trainer
    and a loop's ``model.train()`` undo, but Lightning keeps)."""

    def __init__(self, seed: int, *, dropout: float = 0.0, in_eval: bool = True) -> None:
        super().__init__()
        self.student = lora_llama(seed=seed)
        self.teacher = tiny_llama(seed=seed + 1)
        for module in self.teacher.modules():
            if hasattr(module, "attention_dropout"):  # dropout on the attention weights
                module.attention_dropout = dropout
        self.teacher.requires_grad_(False).train(not in_eval)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> CausalLMOutput:
        out = self.student(input_ids=input_ids, labels=labels)
        with torch.no_grad():
            target = self.teacher(input_ids=input_ids).logits.softmax(-1)
        kl = nn.functional.kl_div(out.logits.log_softmax(-1), target, reduction="batchmean")
        return CausalLMOutput(loss=out.loss + kl, logits=out.logits)


def _distill_spec(**keys: object) -> Callable[[nn.Module], IsolationSpec]:
    """The student's spec from PEFT, under ``student``, with a teacher contract and ``keys``."""

    def spec(model: nn.Module) -> IsolationSpec:
        data = spec_for(model.student).prefixed("student").to_dict()
        data["contracts"].append({"kind": "teacher", "name": "teacher", "select": ["teacher"]})
        for key, value in keys.items():
            data[key] = [*data[key], *value] if isinstance(value, list) else value
        return IsolationSpec.from_dict(data)

    return spec


def _teacher_in_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The student's trainable tensors and, in a group of its own, the frozen teacher."""
    student = [p for p in model.student.parameters() if p.requires_grad]
    teacher = list(model.teacher.parameters())
    return torch.optim.AdamW([{"params": student}, {"params": teacher}], lr=1e-2, weight_decay=0.1)


FAULTS = {
    "clean": Fault(_clean),
    "clean_reentrant_checkpointing": Fault(_reentrant),
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
    "reregistered_base_weight_joins_the_optimizer": Fault(
        lambda seed: lora_llama(seed=seed),
        ReplacedParameterError,
        rf"at attach, the spec's parameter '(model\.)?{DOWN}\.weight' was replaced or removed "
        rf"after it was applied:\n  (model\.)?{DOWN}\.weight \(frozen\): a new object; "
        r"requires grad \(the spec's object: requires_grad=False\); in optimizer 0, group 0\n",
        optimizer=_reregistered,
    ),
    "frozen_teacher_left_in_the_optimizer": Fault(
        Distill,
        SpecError,
        r"frozen parameters sit in an optimizer, where a zero gradient with weight decay or "
        rf"momentum can still move them:\n  {TEACHER}: optimizer 0, param group 1 \("
        r"weight_decay=0.1 shrinks it",
        spec=_distill_spec(freeze=["teacher"], mode="eval", frozen_in_optimizer="error"),
        optimizer=_teacher_in_optimizer,
    ),
    "frozen_teacher_dropout_in_train_mode": Fault(
        lambda seed: Distill(seed, dropout=0.1, in_eval=False),
        ContractError,
        r"contract 'teacher' \(teacher\) breaks its clause 'in eval mode': \["
        r"'(model\.)?teacher\.model\.layers\.0\.self_attn'.* run in train mode",
        spec=_distill_spec(),
    ),
    "frozen_base_dropout_held_in_eval": Fault(
        _base_dropout,
        loss=_train_again,
        spec=lambda model: spec_for(model, mode="eval", mixed="follow"),
        after=_held_in_eval_lora_dropout_in_train,
    ),
    "frozen_base_attention_dropout_under_an_adapter_in_train_mode": Fault(
        lambda seed: _base_dropout(seed, attention=0.1),
        SpecError,
        r"mode='eval' cannot hold 2 mode-dependent modules in eval mode: "
        r"\['base_model.model.model.layers.0.self_attn \(LlamaAttention\)'.*lies only in "
        r"modules that hold, tensors the adapter trains.*Fix: .*mixed='follow'",
        spec=lambda model: spec_for(model, mode="eval"),
    ),
}
CLEAN = [f for f, planted in FAULTS.items() if planted.error is None]


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("fault", [f for f in FAULTS if f not in CLEAN])
def test_each_fault_is_caught_with_its_cause_named(runner: str, fault: str, tmp_path: Path) -> None:
    planted = FAULTS[fault]
    assert planted.error is not None
    with pytest.raises(planted.error, match=planted.match):
        RUNNERS[runner]()(planted.build(0), planted, 0, tmp_path)


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("clean", CLEAN)
def test_clean_runs_raise_nothing_over_five_seeds(runner: str, clean: str, tmp_path: Path) -> None:
    """Nothing raised, and exactly the tensors of the active adapter move: LoRA A and B, the
    head's copy, the token rows' delta."""
    for seed in range(5):
        model = FAULTS[clean].build(seed)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        RUNNERS[runner]()(model, FAULTS[clean], seed, tmp_path / str(seed))
        if FAULTS[clean].after is not None:
            FAULTS[clean].after(model)
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        expected = set(spec_for(model).contracts[0].select)
        assert any(".lora_B.default" in n for n in expected), expected
        assert moved == expected, seed
