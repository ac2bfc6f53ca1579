"""PEFT integration: the isolation spec a ``PeftModel`` declares, and what really trains.

A PEFT model already says what must train: its active adapters' tensors (LoRA A/B and the
other tuner tensors), the ``modules_to_save`` copies, the rows ``trainable_token_indices``
lists; everything else stays still. :func:`spec_for` reads that from PEFT's own modules
(:func:`~isolate.peft.layout.layout`) into an :class:`isolate.IsolationSpec`, so that the
handle (or the Lightning callback) proves it while training: the base gets no gradient and
does not move, the originals ``modules_to_save`` keeps stay still, every active adapter
tensor is reached and moves. :func:`check_flags` names the flags that contradict the
adapters (a trainable base tensor, a trainable adapter that is not active, a tied output
head trained through ``modules_to_save``), and :func:`what_trains` separates the tensors
flagged trainable from those that really train.

Needs the ``peft`` extra (``pip install torch-isolate[peft]``); ``import isolate`` does not
import this package.

>>> import torch
>>> from torch import nn
>>> from peft import LoraConfig, get_peft_model
>>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
>>> model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
>>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
>>> handle = spec_for(model).apply(model, opt)
>>> loop = handle.check_every(1)
>>> for step in range(2):
...     _ = loop.begin_step(epoch=0, step=step)
...     loss = model(torch.randn(8, 4)).pow(2).mean()
...     loop.before_backward(loss)
...     loss.backward()
...     opt.step()
...     opt.zero_grad()
...     loop.end_step()
>>> loop.finish()
>>> handle.restore()
"""

from isolate.peft.layout import Layout, Part, layout
from isolate.peft.report import Training, what_trains
from isolate.peft.spec import check_flags, spec_for

__all__ = ["Layout", "Part", "Training", "check_flags", "layout", "spec_for", "what_trains"]
