"""A tiny random-initialised Llama with LoRA adapters, built from a config (no download).

Shared by the tests that need the transformers + PEFT stack; a test module that imports it
should first ``pytest.importorskip("transformers")`` and ``pytest.importorskip("peft")``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

VOCAB = 128


def tiny_llama(
    *, seed: int = 0, hidden: int = 32, layers: int = 2, tied: bool = False
) -> nn.Module:
    """A ``LlamaForCausalLM`` with ``layers`` decoder layers, random weights from ``seed``;
    ``tied``: the output head shares the input embedding's weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lora_llama(
    *,
    seed: int = 0,
    checkpointing: bool | None = None,
    input_grads: bool = True,
    lora: dict[str, Any] | None = None,
    **kw: Any,
) -> nn.Module:
    """A :func:`tiny_llama` with LoRA (r=4) on the attention projections, base frozen.

    Args:
        seed: the seed of the base and adapter weights (LoRA B is made non-zero, so that
            gradients reach LoRA A too).
        checkpointing: ``None`` for none, else transformers' gradient checkpointing with
            ``use_reentrant=checkpointing``.
        input_grads: keep the hook transformers installs with gradient checkpointing that
            makes the embeddings' output require grad; ``False`` removes it, the setup in
            which reentrant checkpointing leaves LoRA without gradient.
        lora: more keys of the ``LoraConfig`` (``modules_to_save``,
            ``trainable_token_indices``, ...).
    """
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(seed=seed, **kw)
    if checkpointing is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old name of the same call
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing}
            )
    keys = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    config = LoraConfig(**{**keys, **(lora or {})})
    logging.getLogger("peft").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PEFT's warning about a tied head
        model = get_peft_model(base, config)
    if checkpointing is not None and not input_grads:
        # transformers and PEFT each register the hook, and disable_input_require_grads()
        # removes only the last one registered.
        embeddings = model.get_input_embeddings()
        for key, hook in list(embeddings._forward_hooks.items()):
            if getattr(hook, "__name__", "") == "make_inputs_require_grads":
                del embeddings._forward_hooks[key]
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    model.train()
    return model


def batch(*, seed: int = 0, size: int = 2, length: int = 8) -> dict[str, torch.Tensor]:
    """Token ids and labels for a causal-LM loss."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, length), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
