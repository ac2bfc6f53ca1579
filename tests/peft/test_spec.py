"""The spec a PEFT model declares, against PEFT itself: what it trains, what it refuses, and
the proofs while training (tokens rows bitwise still under AdamW with weight decay)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from isolate.errors import AdapterStateError, ContractError, IsolationTypeError, SpecError
from isolate.freezing import held_in_eval
from isolate.peft import check_flags, layout, spec_for, what_trains
from tests._llama import VOCAB, batch, lora_llama, tiny_llama, trainable

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]
EMBED = "base_model.model.model.embed_tokens"
ROWS = [3, 5, 17]


def _two_adapters(**lora: Any) -> torch.nn.Module:
    from peft import LoraConfig

    model = lora_llama(lora=lora)
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj", "o_proj"], **lora))
    return model


CONFIGS = {
    "lora": lambda: lora_llama(),
    "modules_to_save": lambda: lora_llama(lora={"modules_to_save": ["lm_head"]}),
    "trainable_tokens": lambda: lora_llama(lora={"trainable_token_indices": ROWS}),
    "two_adapters": lambda: _two_adapters(modules_to_save=["lm_head"]),
    "bias_all": lambda: lora_llama(lora={"bias": "all"}),
}


def _frozen_base(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_spec_trains_what_peft_marks_trainable_and_freezes_the_rest(config: str) -> None:
    model = CONFIGS[config]()
    peft_trainable = {n for n, _ in trainable(model)}
    spec = spec_for(model)
    (contract,) = spec.contracts
    assert set(contract.select) == peft_trainable
    names = {n for n, _ in model.named_parameters()}
    assert set(spec.freeze) == names - peft_trainable
    expects = spec.expectations(model)
    assert {n for n, e in expects.items() if e == "moves"} == peft_trainable


def test_the_layout_reads_each_kind_of_tensor_from_peft_modules() -> None:
    model = _two_adapters(modules_to_save=["lm_head"], trainable_token_indices=ROWS)
    parts = layout(model).parts
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert (
        parts[f"{q}.lora_A.default.weight"].role,
        parts[f"{q}.lora_A.default.weight"].trains,
    ) == (
        "adapter",
        True,
    )
    assert parts[f"{q}.lora_A.other.weight"].active is False
    assert parts[f"{q}.base_layer.weight"].role == "base"
    assert parts["base_model.model.lm_head.original_module.weight"].role == "original"
    assert parts["base_model.model.lm_head.modules_to_save.default.weight"].role == "saved"
    delta = parts[f"{EMBED}.token_adapter.trainable_tokens_delta.default"]
    assert (delta.role, delta.rows) == ("tokens", tuple(ROWS))
    assert parts[f"{EMBED}.token_adapter.base_layer.weight"].role == "base"
    assert layout(model).active == ("default",)


def test_a_model_without_peft_is_refused() -> None:
    with pytest.raises(IsolationTypeError, match=r"^spec_for\(\): LlamaForCausalLM holds no PEFT"):
        spec_for(tiny_llama())


def test_a_trainable_base_tensor_is_named_with_the_fix() -> None:
    model = lora_llama()
    model.base_model.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(AdapterStateError, match=r"^spec_for\(\): 1 base tensors require grad") as e:
        spec_for(model)
    assert "'base_model.model.model.norm.weight'" in str(e.value)
    assert "modules_to_save" in str(e.value)


def test_a_trainable_embedding_is_pointed_at_trainable_token_indices() -> None:
    model = lora_llama()
    model.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(AdapterStateError, match=f"'{EMBED}.weight'.*trainable_token_indices"):
        spec_for(model)


def test_an_inactive_adapter_that_trains_is_named_with_set_adapter() -> None:
    model = _two_adapters()
    for name, p in model.named_parameters():
        if ".other." in name:
            p.requires_grad_(True)
    with pytest.raises(
        AdapterStateError,
        match=r"adapter 'other' is not active \(active: \['default'\]\) but 8 of its tensors "
        r"require grad: .*model.set_adapter\('default'\)",
    ):
        spec_for(model)


def test_an_active_adapter_that_cannot_train_is_named() -> None:
    model = lora_llama()
    model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.requires_grad_(
        False
    )
    with pytest.raises(
        AdapterStateError, match=r"1 tensors of the active adapter\(s\) .*is_trainable=True"
    ):
        spec_for(model)


def test_a_tied_head_trained_through_modules_to_save_is_named() -> None:
    model = lora_llama(tied=True, lora={"modules_to_save": ["lm_head"]})
    with pytest.raises(
        AdapterStateError,
        match=r"base_model.model.lm_head is trained through modules_to_save, but its original "
        rf"weight is tied to '{EMBED}.weight'.*ensure_weight_tying=True",
    ):
        check_flags(model)


def test_a_tied_weight_deeper_inside_a_saved_module_is_named() -> None:
    from peft import LoraConfig, get_peft_model

    net = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(8, 4),
            "mid": torch.nn.Linear(4, 4),
            "head": torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False)),
        }
    )
    net["head"][0].weight = net["embed"].weight  # tied one level down in the saved module
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["mid"], modules_to_save=["head"]))
    with pytest.raises(
        AdapterStateError,
        match=r"base_model\.model\.head is trained through modules_to_save, but its original "
        r"weight is tied to 'base_model\.model\.embed\.weight': the trained copy "
        r"'base_model\.model\.head\.modules_to_save\.default\.0\.weight' unties them",
    ):
        check_flags(model)


def test_a_tied_head_trained_as_one_tensor_with_its_embedding_is_accepted() -> None:
    model = lora_llama(
        tied=True,
        lora={"modules_to_save": ["lm_head", "embed_tokens"], "ensure_weight_tying": True},
    )
    assert set(spec_for(model).contracts[0].select) == {n for n, _ in trainable(model)}


def _train(model: torch.nn.Module, steps: int, *, seed: int = 0, wd: float = 0.1) -> Any:
    """A plain loop driven by the handle's Loop, checking every step; AdamW with weight decay
    over every parameter (the spec takes the frozen ones out)."""
    handle = spec_for(model).apply(model)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=wd
    )
    handle.attach(opt)
    loop = handle.check_every(1)
    try:
        for step in range(steps):
            loop.begin_step(epoch=0, step=step)
            data = batch(seed=seed * 100 + step)
            data["input_ids"][:, : len(ROWS)] = torch.tensor(ROWS)  # every listed row is used
            loss = model(**data).loss
            loop.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.end_step()
        loop.finish()
        return handle.tally
    finally:
        handle.restore()


def test_trainable_tokens_move_only_their_rows_bitwise_under_adamw_weight_decay() -> None:
    model = lora_llama(lora={"trainable_token_indices": ROWS})
    wrapper = model.get_input_embeddings()
    before = wrapper.token_adapter.get_merged_weights(["default"]).detach().clone()
    base = _frozen_base(model)
    tally = _train(model, 3)
    after = wrapper.token_adapter.get_merged_weights(["default"]).detach()
    others = [i for i in range(VOCAB) if i not in ROWS]
    for row in others:  # each slice, bitwise
        assert torch.equal(after[row], before[row]), row
    assert all(not torch.equal(after[row], before[row]) for row in ROWS)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    assert tally.times["drift"] == 4 and tally.times["contracts"] >= 1


def test_a_gradient_mask_does_not_keep_adamw_from_moving_the_masked_rows() -> None:
    """The fault the spec refuses is real: brute force, with no isolate in the loop."""
    model = lora_llama()
    weight = model.get_input_embeddings().weight
    weight.requires_grad_(True)
    mask = torch.zeros(VOCAB, 1)
    mask[ROWS] = 1.0
    hook = weight.register_hook(lambda g: g * mask)
    before = weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], weight_decay=0.1)
    model(**batch()).loss.backward()
    opt.step()
    hook.remove()
    moved = (weight.detach() != before).any(dim=1)
    assert moved[[0, 1, 2]].all()  # masked rows, moved by the decay alone


def test_clean_training_proves_base_still_and_every_adapter_tensor_moving() -> None:
    model = lora_llama(lora={"modules_to_save": ["lm_head"]})
    base = _frozen_base(model)
    lora = {n: p.detach().clone() for n, p in trainable(model)}
    tally = _train(model, 3)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    assert all(not torch.equal(p, lora[n]) for n, p in model.named_parameters() if n in lora)
    assert tally.last["drift"].drift == len(base)
    assert tally.last["reach"].reach == len(lora)


def test_an_adapter_tensor_that_never_moves_breaks_the_trains_contract() -> None:
    model = lora_llama()
    handle_lr0 = spec_for(model, within=1)
    handle = handle_lr0.apply(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    handle.attach(opt)
    loop = handle.check_every(1)
    try:
        with pytest.raises(ContractError, match=r"peft:default.*did not change"):
            for step in range(3):
                loop.begin_step(epoch=0, step=step)
                loss = model(**batch(seed=step)).loss
                loop.before_backward(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
                loop.end_step()
    finally:
        handle.restore()


def test_what_trains_separates_flags_from_training() -> None:
    model = lora_llama(lora={"modules_to_save": ["lm_head"]})
    model.base_model.model.model.norm.weight.requires_grad_(True)
    params = [p for n, p in trainable(model) if "lm_head" not in n]
    opt = torch.optim.AdamW(params)
    found = what_trains(model, model(**batch()).loss, opt)
    head = "base_model.model.lm_head.modules_to_save.default.weight"
    assert set(found.flagged) == {n for n, _ in trainable(model)}
    assert found.idle == {head: "in no optimizer"}
    assert head not in found.training and len(found.training) == len(found.flagged) - 1
    assert list(found.wrong) == ["base_model.model.model.norm.weight"]
    assert (
        "requires grad, but it is the base weight"
        in found.wrong["base_model.model.model.norm.weight"]
    )
    text = str(found)
    assert text.splitlines()[-1].startswith("flagged trainable ")
    assert f"idle    {head}" in text


def test_what_trains_reads_its_ledger_against_what_peft_means() -> None:
    model = lora_llama(lora={"modules_to_save": ["lm_head"]})
    norm = "base_model.model.model.norm.weight"
    model.get_parameter(norm).requires_grad_(True)
    found = what_trains(model, model(**batch()).loss)
    rows = {r.name: r for r in found.ledger.rows}
    assert set(rows) == set(found.layout.params)
    assert rows[norm].expects == "still"
    assert "trainable but the spec expects it still" in rows[norm].reasons
    head = "base_model.model.lm_head.modules_to_save.default.weight"
    assert rows[head].expects == "moves" and not rows[head].reasons


def test_what_trains_of_a_model_without_peft_names_itself() -> None:
    with pytest.raises(IsolationTypeError, match=r"^what_trains\(\): "):
        what_trains(torch.nn.Linear(2, 2), torch.zeros(()))


def test_mode_eval_holds_the_whole_frozen_modules_and_not_the_adapters_dropout() -> None:
    """LoRA on the MLP only: the attention layers are frozen whole and held in eval mode
    through ``model.train()``; LoRA's own dropout follows the model's mode."""
    model = lora_llama(lora={"target_modules": ["gate_proj"], "lora_dropout": 0.1})
    spec = spec_for(model, mode="eval")
    attention = [f"base_model.model.model.layers.{i}.self_attn" for i in (0, 1)]
    assert set(attention) <= set(spec.freeze)
    handle = spec.apply(model)
    try:
        model.train()
        assert held_in_eval(model) == tuple(attention)
        lora = "base_model.model.model.layers.0.mlp.gate_proj.lora_dropout.default"
        assert isinstance(model.get_submodule(lora), torch.nn.Dropout)
        model(**batch())
        assert not model.get_submodule(attention[0]).training
        assert model.get_submodule(lora).training
    finally:
        handle.restore()
    assert held_in_eval(model) == ()
    assert spec_for(model).freeze == spec_for(model, mode=None).freeze  # names tensors only
    assert not any(n.endswith("self_attn") for n in spec_for(model).freeze)


def test_mode_eval_refuses_a_mixed_module_unless_told_to_let_it_follow() -> None:
    model = lora_llama()  # LoRA on q_proj and v_proj, inside LlamaAttention
    with pytest.raises(SpecError, match=r"^spec_for\(\): mode='eval' cannot hold 2 "):
        spec_for(model, mode="eval")
    spec = spec_for(model, mode="eval", mixed="follow")
    assert not any(n.endswith("self_attn") for n in spec.freeze)
    assert spec_for(model, mode="train").mode == "train"  # a mixed module follows anyway
    with pytest.raises(SpecError, match=r"mixed must be 'error' or 'follow', got 'hold'"):
        spec_for(model, mixed="hold")  # type: ignore[arg-type]


def test_what_trains_names_a_flagged_tensor_no_loss_reaches() -> None:
    from peft import LoraConfig, get_peft_model

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.AdamW(lora)
    loss = model.base_model.model[0](torch.randn(3, 4)).sum()  # stops before module 2
    found = what_trains(model, loss, opt)
    saved = "base_model.model.2.modules_to_save.default"
    assert found.idle == {
        f"{saved}.weight": "no loss reaches it and in no optimizer",
        f"{saved}.bias": "no loss reaches it and in no optimizer",
    }
    assert len(found.training) == 2


def test_a_weight_the_variant_freezes_is_not_expected_to_train() -> None:
    from peft import LoraConfig, get_peft_model

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"]))
    # As PEFT's LoRA variants that keep A fixed record it (peft.tuners.lora.variants).
    model.base_model.model[0].frozen_peft_weight_names = {"default": ("lora_A",)}
    parts = layout(model).parts
    assert not parts["base_model.model.0.lora_A.default.weight"].trains
    assert parts["base_model.model.0.lora_B.default.weight"].trains


def _injected() -> torch.nn.Module:
    """LoRA injected by hand into module ``0`` of a plain model (no ``PeftModel`` around it):
    top-level module names, and ``2`` a frozen module with modules inside."""
    from peft import LoraConfig, inject_adapter_in_model

    net = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
    )
    net = inject_adapter_in_model(LoraConfig(r=2, target_modules="0"), net)
    for name, p in net.named_parameters():
        p.requires_grad_("lora_" in name)
    return net


def test_mode_names_each_largest_frozen_module_once_even_at_the_top() -> None:
    spec = spec_for(_injected(), mode="eval")
    tensors = ("0.base_layer.weight", "0.base_layer.bias")
    tensors += ("2.0.weight", "2.0.bias", "2.1.weight", "2.1.bias")
    assert spec.freeze == (*tensors, "0.base_layer", "2")


def test_the_contract_trains_the_active_adapters_within_two_steps_by_default() -> None:
    model = _two_adapters()
    model.base_model.set_adapter(["default", "other"])
    (contract,) = spec_for(model).contracts
    assert (contract.kind, contract.name, contract.within) == ("trains", "peft:default,other", 2)
    assert spec_for(model, within=5).contracts[0].within == 5


def _hot_base(model: torch.nn.Module, count: int) -> list[str]:
    names = [n for n, p in model.named_parameters() if ".layers." in n and "lora_" not in n]
    names = names[:count]
    for name in names:
        model.get_parameter(name).requires_grad_(True)
    return names


def test_a_long_list_of_tensors_shows_six_and_counts_the_rest() -> None:
    model = lora_llama()
    names = _hot_base(model, 8)
    with pytest.raises(AdapterStateError) as e:
        check_flags(model)
    assert f"8 base tensors require grad: {names[:6]} and 2 more; PEFT froze" in str(e.value)


def test_a_list_of_six_tensors_is_shown_whole() -> None:
    model = lora_llama()
    names = _hot_base(model, 6)
    with pytest.raises(AdapterStateError) as e:
        check_flags(model)
    assert f"6 base tensors require grad: {names}; PEFT froze" in str(e.value)


def test_a_mixed_module_refusal_names_each_module_its_class_and_an_adapter_tensor() -> None:
    """LoRA's own dropout (p=0.1, read in train mode) is let through wherever it comes."""
    model = lora_llama(lora={"lora_dropout": 0.1})
    attention = "base_model.model.model.layers.{}.self_attn (LlamaAttention)"
    q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    with pytest.raises(SpecError) as e:
        spec_for(model, mode="eval")
    assert str(e.value).startswith(
        f"spec_for(): mode='eval' cannot hold 2 mode-dependent modules in eval mode: "
        f"{[attention.format(0), attention.format(1)]}; each reads .training in its own "
        f"forward, and a spec holds a module in eval mode only by freezing it, or a module "
        f"around it, whole, but each of these holds, or lies only in modules that hold, "
        f"tensors the adapter trains (as {q!r}). Fix:"
    )


class _Shift(torch.nn.Module):
    """A learned shift added in train mode only: it reads ``.training`` and holds one bias."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias if self.training else x


def test_a_mode_dependent_module_the_config_trains_whole_follows_the_model() -> None:
    """``bias="all"`` trains the shift's only tensor: the module is the adapter's, not mixed."""
    from peft import LoraConfig, get_peft_model

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), _Shift(), torch.nn.Linear(4, 2, bias=False))
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], bias="all"))
    spec = spec_for(model, mode="eval")
    assert "base_model.model.1.bias" in spec.contracts[0].select
    handle = spec.apply(model)
    try:
        model.train()
        model(torch.randn(2, 4))
        assert held_in_eval(model) == () and model.base_model.model[1].training
    finally:
        handle.restore()


def test_mode_freezes_a_prompt_tuned_base_whole_by_one_name() -> None:
    """The base holds every frozen tensor and nothing else: the spec names it alone."""
    from peft import PromptTuningConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    )
    spec = spec_for(model, mode="eval")
    frozen = tuple(n for n, p in model.named_parameters() if not p.requires_grad)
    assert spec.freeze == (*frozen, "base_model")


class _Block(torch.nn.Module):
    """A scale of its own, a dropout and a linear layer (that LoRA adapts)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.drop = torch.nn.Dropout(0.1)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.drop(x)) * self.scale


def test_a_dropout_beside_an_adapted_layer_is_refused_though_its_parent_holds_a_base_tensor() -> (
    None
):
    """The block holds a frozen tensor of its own: that makes it no module PEFT inserted."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_Block(), LoraConfig(r=2, target_modules=["lin"]))
    with pytest.raises(
        SpecError,
        match=r"cannot hold 1 mode-dependent modules in eval mode: "
        r"\['base_model\.model\.drop \(Dropout\)'\]; each reads \.training in its own forward, "
        r"and a spec holds a module in eval mode only by freezing it, or a module around it, "
        r"whole, but each of these holds, or lies only in modules that hold, tensors the "
        r"adapter trains \(as 'base_model\.model\.lin\.lora_A\.default\.weight'\)",
    ):
        spec_for(model, mode="eval")


def _noise_layer() -> torch.nn.Module:
    """A tuner layer of PEFT's kind that holds nothing but its adapter's tensor and reads its
    mode (a learned offset added in train mode only)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    class Noise(torch.nn.Module, BaseTunerLayer):  # type: ignore[misc]
        adapter_layer_names = ("offset",)

        def __init__(self) -> None:
            super().__init__()
            self.offset = torch.nn.ParameterDict({"default": torch.nn.Parameter(torch.zeros(4))})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.offset["default"] if self.training else x

    return Noise()


def test_a_mode_dependent_tuner_layer_holding_every_trained_tensor_follows_the_model() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4).requires_grad_(False), _noise_layer())
    spec = spec_for(net, mode="eval")
    assert spec.freeze == ("0.weight", "0.bias", "0")
    assert spec.contracts[0].select == ("1.offset.default",)


def test_an_adapter_that_trains_while_none_is_active_is_named_with_its_own_set_adapter() -> None:
    net = _injected()  # the model knows no active adapter; the layer is told to use none
    net[0].enable_adapters(False)
    net[0].lora_A["default"].weight.requires_grad_(True)
    net[0].lora_B["default"].weight.requires_grad_(True)
    with pytest.raises(AdapterStateError) as e:
        check_flags(net)
    assert str(e.value) == (
        "check_flags(): adapter 'default' is not active, and none is, but 2 of its tensors "
        "require grad: ['0.lora_A.default.weight', '0.lora_B.default.weight']. "
        "Fix: model.set_adapter('default')"
    )


def test_a_trainable_original_kept_by_modules_to_save_is_named_as_a_base_tensor() -> None:
    model = lora_llama(lora={"modules_to_save": ["lm_head"]})
    original = "base_model.model.lm_head.original_module.weight"
    model.get_parameter(original).requires_grad_(True)
    with pytest.raises(AdapterStateError) as e:
        check_flags(model)
    assert str(e.value).startswith(f"check_flags(): 1 base tensors require grad: [{original!r}];")
    assert str(e.value).endswith("so that PEFT trains a copy and keeps the original.")


def test_only_a_trainable_embedding_is_told_of_trainable_token_indices() -> None:
    model = lora_llama()
    model.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(AdapterStateError) as e:
        check_flags(model)
    assert str(e.value).endswith(
        "keeps the original. To train some rows of an embedding, give PEFT "
        "trainable_token_indices (a weight decay cannot move the other rows then; a gradient "
        "mask does not stop it)."
    )


def test_adapters_that_train_nothing_are_refused_by_name() -> None:
    model = lora_llama()
    model.base_model.disable_adapter_layers()  # every layer uses no adapter, flags off
    with pytest.raises(SpecError) as e:
        spec_for(model)
    assert str(e.value) == (
        "spec_for(): the active adapters ['default'] hold no tensor to train (of the adapters "
        "['default']); set one active: model.set_adapter(name)"
    )


def test_keys_of_the_spec_pass_through_and_freeze_and_contracts_add_to_the_derived() -> None:
    model = lora_llama()
    head = "base_model.model.lm_head"
    teacher = {"kind": "teacher", "select": head}
    spec = spec_for(model, freeze=head, contracts=teacher, mode="train")
    assert spec.freeze == (*spec_for(model, mode="train").freeze, head)
    assert [(c.kind, c.name) for c in spec.contracts] == [
        ("trains", "peft:default"),
        ("teacher", f"teacher:{head}"),
    ]
    assert spec.mode == "train"
    with pytest.raises(SpecError) as e:
        spec_for(model, frz=head, bogus=1)
    assert str(e.value) == "spec_for(): ['bogus', 'frz'] are not keys of IsolationSpec"


def test_every_problem_of_a_model_is_named_on_its_own_line() -> None:
    model = _two_adapters()
    norm = "base_model.model.model.norm.weight"
    model.get_parameter(norm).requires_grad_(True)
    for name, p in model.named_parameters():
        if ".other." in name:
            p.requires_grad_(True)
    with pytest.raises(AdapterStateError) as e:
        check_flags(model, caller="mine()")
    first, second = str(e.value).split("\n")
    assert first.startswith(f"mine(): 1 base tensors require grad: [{norm!r}];")
    assert second.startswith("adapter 'other' is not active (active: ['default']) but 8 of")


def test_an_inactive_adapters_copy_of_a_tied_head_is_no_untying() -> None:
    """Only the copy that trains unties the head from its embedding."""
    from peft import LoraConfig

    model = lora_llama(tied=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PEFT's warning about the tied head
        model.add_adapter(
            "other", LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
        )
    found = check_flags(model)
    assert found.parts["base_model.model.lm_head.modules_to_save.other.weight"].trains is False


def test_a_head_tied_to_an_embedding_that_comes_after_it_is_named() -> None:
    from peft import LoraConfig, get_peft_model

    net = torch.nn.ModuleDict(
        {
            "head": torch.nn.Linear(4, 8, bias=False),
            "mid": torch.nn.Linear(4, 4),
            "embed": torch.nn.Embedding(8, 4),
        }
    )
    net["head"].weight = net["embed"].weight  # the head's name comes first
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["mid"], modules_to_save=["head"]))
    with pytest.raises(
        AdapterStateError, match=r"weight is tied to 'base_model\.model\.embed\.weight'"
    ):
        check_flags(model)


def test_a_tensor_only_the_trained_copy_holds_is_not_looked_for_in_the_original() -> None:
    from peft import LoraConfig, get_peft_model

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
    copy = model.base_model.model[2].modules_to_save["default"]
    copy.register_parameter("scale", torch.nn.Parameter(torch.ones(2)))
    found = check_flags(model)
    assert found.parts["base_model.model.2.modules_to_save.default.scale"].role == "saved"
