"""The networks the sections time, and a gradient reversal written by hand."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

__all__ = [
    "LlamaShape",
    "LlamaSizes",
    "ReverseByHand",
    "llama_lora",
    "mnist_net",
    "resnet_net",
    "transformer",
]


def mnist_net() -> tuple[nn.Module, nn.Module, Callable[[int], torch.Tensor]]:
    """The MNIST CNN as (trunk, head, a batch of ``n`` random images)."""
    trunk = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
    )  # fmt: skip
    return trunk, nn.Linear(128, 10), lambda n: torch.randn(n, 1, 28, 28)


def resnet_net(size: int) -> tuple[nn.Module, nn.Module, Callable[[int], torch.Tensor]]:
    """ResNet-18 without its classifier as (trunk, head, ``n`` random ``size``-pixel images)."""
    import torchvision

    resnet = torchvision.models.resnet18(weights=None)
    resnet.fc = nn.Identity()  # type: ignore[assignment]
    return resnet, nn.Linear(512, 10), lambda n: torch.randn(n, 3, size, size)


def transformer(layers: int, width: int, heads: int) -> nn.TransformerEncoder:
    """A seeded transformer encoder (the same on every rank), without dropout."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


@dataclass(frozen=True)
class LlamaSizes:
    """The sizes of a Llama built from a config (the default: TinyLlama's, 1.1B parameters);
    a section's config that sizes a Llama derives from it."""

    hidden: int = 2048
    intermediate: int = 5632
    layers: int = 22
    heads: int = 32
    kv_heads: int = 4
    vocab: int = 32000

    def with_positions(self, positions: int) -> LlamaShape:
        """The :class:`LlamaShape` of these sizes, embedding ``positions`` positions."""
        sizes = {f.name: getattr(self, f.name) for f in fields(LlamaSizes)}
        return LlamaShape(**sizes, positions=positions)


@dataclass(frozen=True)
class LlamaShape(LlamaSizes):
    """The shape of a Llama built from a config: its sizes and its positions."""

    positions: int = 2048


def llama_lora(shape: LlamaShape, *, reentrant: bool | None, rank: int = 8) -> nn.Module:
    """A random-initialised ``LlamaForCausalLM`` of ``shape`` (seeded; nothing downloaded)
    with PEFT's LoRA adapters of rank ``rank`` on the attention's q and v projections, the
    base frozen by PEFT, in train mode.

    ``reentrant``: ``None`` for no gradient checkpointing, else transformers'
    ``gradient_checkpointing_enable`` with ``use_reentrant=reentrant`` (PEFT's
    ``prepare_model_for_kbit_training`` asks for ``True``; transformers' own default is
    ``False``). Needs ``transformers`` and ``peft`` (the ``peft`` extra).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.positions,
        use_cache=False,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    if reentrant is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old name of the same call
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
    logging.getLogger("peft").setLevel(logging.ERROR)
    lora = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
    )
    model = get_peft_model(base, lora)
    model.train()
    return model


class ReverseByHand(torch.autograd.Function):
    """The gradient reversal as one would write it without isolate."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad
