"""What :func:`isolate.peft.layout` reads from PEFT's own modules, tensor by tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from isolate.errors import IsolationTypeError
from isolate.peft import Part, layout, spec_for
from tests._llama import batch, lora_llama, tiny_llama

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning"),
]


def _prompt_config(kind: str) -> Any:
    import peft

    keys = {"task_type": "CAUSAL_LM", "num_virtual_tokens": 4}
    if kind == "p_tuning":
        return peft.PromptEncoderConfig(**keys, encoder_hidden_size=8)
    return {"prompt": peft.PromptTuningConfig, "prefix": peft.PrefixTuningConfig}[kind](**keys)


@pytest.mark.parametrize("kind", ["prompt", "prefix", "p_tuning"])
def test_a_prompt_learning_model_trains_its_prompt_encoder_and_keeps_the_base_still(
    kind: str,
) -> None:
    """Prompt learning inserts no tuner layer: its only adapter is ``model.prompt_encoder``
    (it was refused as "no PEFT tuner layer" before)."""
    from peft import get_peft_model

    model = get_peft_model(tiny_llama(), _prompt_config(kind))
    found = layout(model)
    encoder = {n for n, _ in model.named_parameters() if n.startswith("prompt_encoder.default.")}
    assert (
        set(found.trains) == encoder == {n for n, p in model.named_parameters() if p.requires_grad}
    )
    assert (found.active, found.adapters) == (("default",), ("default",))
    part = found.parts["prompt_encoder.default.embedding.weight"]
    assert part == Part("adapter", "default", True, "prompt_encoder.default", (), True)
    assert {found.parts[n].role for n in found.frozen} == {"base"}
    handle = spec_for(model).apply(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    handle.attach(opt)
    loop = handle.check_every(1)
    try:
        for step in range(2):
            loop.begin_step(epoch=0, step=step)
            loss = model(**batch(seed=step)).loss
            loop.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.end_step()
        loop.finish()
        assert handle.tally.last["reach"].reach == len(encoder)
    finally:
        handle.restore()


def test_lora_injected_without_a_peft_model_names_the_adapters_active_in_its_layers() -> None:
    """``peft.inject_adapter_in_model`` leaves no ``PeftModel`` (no ``active_adapters``) around
    the model: the layers' active adapters stand for the model's (it was none, and the
    contract was named ``peft:``)."""
    from peft import LoraConfig, inject_adapter_in_model

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    net = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0", "2"]), net)
    found = layout(net)
    assert (found.active, found.adapters) == (("default",), ("default",))
    (contract,) = spec_for(net).contracts
    assert contract.name == "peft:default"
    net[0].enable_adapters(False)
    found = layout(net)
    assert found.active == ("default",)  # still active in layer 2
    assert not found.parts["0.lora_A.default.weight"].active
    assert found.parts["2.lora_A.default.weight"].active
    net[2].enable_adapters(False)
    assert layout(net).active == ()


def test_each_part_describes_itself_word_for_word() -> None:
    """The words reports and refusals use for each role (``what_trains``, ``check_flags``)."""
    from peft import LoraConfig

    model = lora_llama(lora={"modules_to_save": ["lm_head"], "trainable_token_indices": [3, 5]})
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    parts = layout(model).parts
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    embed = "base_model.model.model.embed_tokens"
    described = {
        f"{q}.base_layer.weight": f"base weight of {q}.base_layer",
        f"{q}.lora_A.default.weight": "adapter tensor of adapter 'default' (active)",
        f"{q}.lora_A.other.weight": "adapter tensor of adapter 'other' (not active)",
        "base_model.model.lm_head.original_module.weight": (
            "original kept by modules_to_save of base_model.model.lm_head"
        ),
        "base_model.model.lm_head.modules_to_save.default.weight": (
            "modules_to_save copy of adapter 'default' (active)"
        ),
        f"{embed}.token_adapter.trainable_tokens_delta.default": (
            "trainable tokens (rows [3, 5]) of adapter 'default' (active)"
        ),
    }
    assert {name: parts[name].describe() for name in described} == described
    # The wrapper, not the layer inside it, is the module that holds the delta.
    assert parts[f"{embed}.token_adapter.trainable_tokens_delta.default"].module == embed
    assert Part("base").describe() == "base weight"
    assert Part("original").describe() == "original kept by modules_to_save"
    assert Part("bias", "b", True, "lin").describe() == (
        "bias the adapter config trains of adapter 'b' (active)"
    )


class _Top(torch.nn.Module):
    """A layer to adapt, a head, and a bias of the model's own (named ``bias`` at the top)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)
        self.bias = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lin(x)) + self.bias


def test_bias_all_trains_every_bias_in_its_own_module_as_peft_does() -> None:
    from peft import LoraConfig, inject_adapter_in_model

    net = inject_adapter_in_model(LoraConfig(r=2, target_modules=["lin"], bias="all"), _Top())
    found = layout(net)
    bias = {n: p for n, p in found.parts.items() if p.role == "bias"}
    assert bias == {
        "bias": Part("bias", "default", True, "", (), True),
        "lin.base_layer.bias": Part("bias", "default", True, "lin.base_layer", (), True),
        "head.bias": Part("bias", "default", True, "head", (), True),
    }
    assert set(found.trains) == {n for n, p in net.named_parameters() if p.requires_grad}


def test_bias_lora_only_trains_the_biases_of_the_adapted_layers_only() -> None:
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=2, target_modules=["lin"], bias="lora_only")
    net = inject_adapter_in_model(config, _Top())
    found = layout(net)
    assert {n: p for n, p in found.parts.items() if p.role == "bias"} == {
        "lin.base_layer.bias": Part("bias", "default", True, "lin", (), True),
    }
    assert found.parts["bias"] == Part("base", module="")
    assert set(found.trains) == {n for n, p in net.named_parameters() if p.requires_grad}


def test_the_biases_of_the_active_adapter_with_bias_are_read_after_one_without() -> None:
    """PEFT allows one adapter with a bias; the one before it in order (``plain``, ``bias="none"``)
    does not stop the reading, and a ``modules_to_save`` copy's bias stays the copy's."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_Top(), LoraConfig(r=2, target_modules=["lin"]), adapter_name="plain")
    config = LoraConfig(r=2, target_modules=["lin"], bias="all", modules_to_save=["head"])
    model.add_adapter("with_bias", config)
    model.base_model.set_adapter(["plain", "with_bias"])
    found = layout(model)
    assert found.active == found.adapters == ("plain", "with_bias")
    head = "base_model.model.head"
    assert {n: (p.role, p.adapter) for n, p in found.parts.items() if p.role != "adapter"} == {
        "base_model.model.bias": ("bias", "with_bias"),
        "base_model.model.lin.base_layer.weight": ("base", None),
        "base_model.model.lin.base_layer.bias": ("bias", "with_bias"),
        f"{head}.original_module.weight": ("original", None),
        f"{head}.original_module.bias": ("original", None),
        f"{head}.modules_to_save.with_bias.weight": ("saved", "with_bias"),
        f"{head}.modules_to_save.with_bias.bias": ("saved", "with_bias"),
    }


def test_the_layout_lists_names_by_role_and_a_tied_tensor_under_each_of_its_names() -> None:
    model = lora_llama(tied=True)
    found = layout(model)
    embed = "base_model.model.model.embed_tokens.weight"
    assert found.aliases[embed] == (embed, "base_model.model.lm_head.weight")
    assert "base_model.model.lm_head.weight" not in found.parts
    assert all(names == (name,) for name, names in found.aliases.items() if name != embed)
    assert list(found.aliases) == list(found.parts) == list(found.params)
    assert found.params[embed] is model.get_input_embeddings().weight
    assert found.role("adapter") == found.trains
    assert found.role("base") == found.frozen
    assert embed in found.role("base") and found.role("saved") == ()


def test_a_tuner_layer_of_ones_own_may_name_its_active_adapter_and_lack_a_listed_attribute() -> (
    None
):
    """BaseTunerLayer documents ``active_adapters`` as a list or a string; an attribute its
    ``adapter_layer_names`` lists but the layer never set holds no adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    class Shift(torch.nn.Module, BaseTunerLayer):  # type: ignore[misc]
        adapter_layer_names = ("shift", "scale")  # no scale: this layer never adds one

        def __init__(self) -> None:
            super().__init__()
            self.shift = torch.nn.ParameterDict({"mine": torch.nn.Parameter(torch.zeros(4))})

        @property
        def active_adapters(self) -> str:  # type: ignore[override]
            return "mine"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.shift["mine"]

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Shift())
    found = layout(net)
    assert (found.active, found.adapters) == (("mine",), ("mine",))
    assert found.parts["1.shift.mine"] == Part("adapter", "mine", True, "1", (), True)
    assert found.trains == ("1.shift.mine",)
    net.active_adapters = "mine"  # a model may name its active adapter as a string too
    assert layout(net).active == ("mine",)


def test_a_model_without_peft_is_refused_in_layouts_name_with_the_fix() -> None:
    with pytest.raises(IsolationTypeError) as e:
        layout(tiny_llama())
    assert str(e.value) == (
        "layout(): LlamaForCausalLM holds no PEFT tuner layer or modules_to_save wrapper; "
        "wrap it first: peft.get_peft_model(model, config)"
    )


def test_a_peft_without_trainable_tokens_still_reads_its_lora(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PEFT before TrainableTokens (0.13, 0.14) has no ``peft.tuners.trainable_tokens``."""
    import sys

    monkeypatch.setitem(sys.modules, "peft.tuners.trainable_tokens", None)
    model = lora_llama()
    found = layout(model)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert found.parts[f"{q}.lora_A.default.weight"] == Part(
        "adapter", "default", True, q, (), True
    )
    assert set(found.trains) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_a_trainable_tokens_layer_without_a_wrapper_trains_its_rows() -> None:
    """``TrainableTokensConfig`` puts the layer in place of the embedding, with no wrapper
    around it (LoRA's ``trainable_token_indices`` wraps it)."""
    from peft import TrainableTokensConfig, get_peft_model

    config = TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[3, 5])
    model = get_peft_model(tiny_llama(), config)
    found = layout(model)
    embed = "base_model.model.model.embed_tokens"
    delta = Part("tokens", "default", True, embed, (3, 5), True)
    assert found.parts[f"{embed}.trainable_tokens_delta.default"] == delta
    assert set(found.trains) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_lora_injected_without_a_peft_model_is_active_where_any_of_its_layers_is() -> None:
    from peft import LoraConfig, inject_adapter_in_model

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    net = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0", "2"]), net)
    net[2].enable_adapters(False)  # the last layer off, the first on
    found = layout(net)
    assert found.active == ("default",)
    assert found.parts["0.lora_A.default.weight"].trains
    assert not found.parts["2.lora_A.default.weight"].trains


def test_lora_injected_into_a_transformers_model_names_the_adapters_of_its_layers() -> None:
    """A transformers model's ``active_adapters`` is a method (of its own PEFT integration),
    not PEFT's list: the layers' active adapters stand for the model's."""
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), tiny_llama())
    assert callable(model.active_adapters)
    found = layout(model)
    assert (found.active, found.adapters) == (("default",), ("default",))
    assert found.parts["model.layers.0.self_attn.q_proj.lora_A.default.weight"].trains
