"""The audits on the standard PEFT setup: a Llama with LoRA adapters behind transformers'
gradient checkpointing, reentrant or not, compared with a real backward."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from isolate.cutoff import assert_reached, cut_off_parameters, trace_forward
from isolate.errors import CutOffError, GradientLeakError
from isolate.gradients import gradient_invariance, gradient_report
from isolate.reachability import assert_isolated, reachable_parameters
from tests._llama import batch, lora_llama, trainable

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad"),
]

SETUPS = [None, True, False]  # no checkpointing, use_reentrant=True, use_reentrant=False


def real_grads(loss: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in trainable(model)}
    model.zero_grad(set_to_none=True)
    return grads


def _lora(layer: int) -> str:
    return f"*layers.{layer}.*lora_*"


@pytest.mark.parametrize("reentrant", SETUPS)
def test_every_adapter_is_reached_and_measured_as_a_real_backward_finds(
    reentrant: bool | None,
) -> None:
    model = lora_llama(checkpointing=reentrant)
    loss = model(**batch()).loss
    names = [n for n, _ in trainable(model)]
    assert len(names) == 8
    found = reachable_parameters(loss, model)
    assert_reached(loss, model)
    report = gradient_report({"loss": loss}, model, groups={"0": _lora(0), "1": _lora(1)})
    grads = real_grads(loss, model)
    assert found == tuple(n for n, g in grads.items() if g is not None) == tuple(names)
    for layer in ("0", "1"):
        want = math.sqrt(
            sum(
                float(g.pow(2).sum())
                for n, g in grads.items()
                if f"layers.{layer}." in n and g is not None
            )
        )
        assert want > 0
        assert report[layer].norms["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("reentrant", SETUPS)
def test_a_probe_on_the_first_layer_leaks_into_its_adapters_only(reentrant: bool | None) -> None:
    model = lora_llama(checkpointing=reentrant)
    out = model(**batch(), output_hidden_states=True)
    first = out.hidden_states[1]  # the output of decoder layer 0
    probe = first.pow(2).mean()
    layer0 = [p for n, p in trainable(model) if "layers.0." in n]
    layer1 = [p for n, p in trainable(model) if "layers.1." in n]
    assert_isolated(probe, layer1)
    with pytest.raises(GradientLeakError, match=r"reaches 4 of 4 protected"):
        assert_isolated(probe, layer0)
    total = out.loss + probe
    invariance = gradient_invariance(out.loss, total, _lora(1), model=model)
    leaking = gradient_invariance(out.loss, total, _lora(0), model=model)
    grads_main, grads_total = real_grads(out.loss, model), real_grads(total, model)
    for name, delta in {**invariance.deltas, **leaking.deltas}.items():
        a, b = grads_main[name], grads_total[name]
        assert a is not None and b is not None
        assert delta == pytest.approx(float((a - b).abs().max()), abs=1e-7), name
    assert invariance.isolated and not leaking.isolated
    assert {n for n, g in real_grads(probe, model).items() if g is not None} == {
        n for n, _ in trainable(model) if "layers.0." in n
    }


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_without_input_grads(reentrant: bool) -> None:
    """The trap of reentrant checkpointing: when no input of a segment requires grad, its
    forward carries no graph and LoRA gets no gradient. The audits say "cut off", as a real
    backward finds; without reentrancy the adapters are reached."""
    model = lora_llama(checkpointing=reentrant, input_grads=False)
    norm = model.get_base_model().model.norm.weight
    norm.requires_grad_(True)  # something after the layers trains, so the loss has a graph
    with trace_forward(model) as trace:
        loss = model(**batch()).loss
    lora = [n for n, _ in trainable(model) if "lora_" in n]
    cut = cut_off_parameters(loss, model, trace=trace)
    found = reachable_parameters(loss, model)
    report = gradient_report({"loss": loss}, model, groups={"lora": "*lora_*"})
    grads = real_grads(loss, model)
    reached = tuple(n for n, g in grads.items() if g is not None)
    assert found == reached
    if reentrant:
        assert reached == ("base_model.model.model.norm.weight",)
        assert list(cut.parameters) == lora
        assert "reentrant checkpoint whose inputs do not require grad" in str(cut)
        assert report["lora"].norms["loss"] is None
        with pytest.raises(CutOffError, match=r"8 of 9 trainable parameters get no gradient"):
            assert_reached(loss, model)
    else:
        assert len(reached) == 9 and cut.clean
        assert report["lora"].norms["loss"] is not None and report["lora"].norms["loss"] > 0
        assert_reached(loss, model)
