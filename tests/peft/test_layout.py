"""What :func:`isolate.peft.layout` reads from PEFT's own modules, tensor by tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from isolate.peft import layout, spec_for
from tests._llama import batch, tiny_llama

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
    assert (part.role, part.adapter, part.module) == (
        "adapter",
        "default",
        "prompt_encoder.default",
    )
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
