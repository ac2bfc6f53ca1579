"""Benchmarks: what isolation costs and what it saves, each as a ratio against its baseline
measured in the same run.

Run ``python -m experiments.bench`` (``--quick`` for small sizes). Results are printed as a
Markdown table and written to ``outputs/bench/bench.json`` and ``outputs/bench/bench.md``.
The ``scale`` section (``--only scale``) measures the checks on a large model; its size is set
by ``--scale-layers/--scale-width`` (default: 24 encoder layers of width 1024, 302M
parameters, 1.2 GB in fp32; under 3 minutes at one thread on a busy 2-core machine, peak resident
memory under 4 GB).
The ``sharded`` section (``--only sharded``) measures the engine's verification against a
training step under ``fully_shard`` (FSDP2) on 2 CPU processes (gloo); its size is set by
``--sharded-layers/--sharded-width`` (default: 8 encoder layers of width 512, 25M parameters,
40 s on an idle 2-core machine).
The ``peft`` section (``--only peft``) measures the checks on the standard PEFT setup: a
random-initialised Llama built from a config (nothing downloaded) with LoRA r=8 behind
reentrant gradient checkpointing, trained with AdamW on the CPU; its size is set by
``--peft-*`` (default: TinyLlama's shape, 1.1B parameters, 4.4 GB in fp32; with the deep copy
of the peers' way, peak resident memory about 10 GB). The ``seethrough`` section
(``--only seethrough``) times the audits through checkpointed segments and compiled regions
against one forward and one backward (``--seethrough-*`` sizes). Both need the ``peft`` extra.
The ``imports`` section (``--only imports``) times ``import isolate`` against ``import torch``,
each in fresh interpreters.
The ``certify`` section (``--only certify``) times ``isolate certify`` on a synthetic bf16
checkpoint pair against one sequential read of both files, measures its peak resident memory
and plants five corruptions; its size is set by ``--certify-params`` (default 0.5B
parameters, 1 GB per file, a few minutes; ``3000000000`` for the 3B target, 6 GB per file).
The ``contracts`` section (``--only contracts``) measures the contract checks of a check step
against a training step, and the ledger against a backward, on the suite's models and a large
BYOL-like pair (``--contracts-layers/--contracts-width``, default 18 blocks of width 1024, 302M
parameters), at ``--contracts-threads`` (1) torch threads.

Every row states its target as a limit on one number (``metric``, the ratio unless said
otherwise), and ``ok`` is that limit applied to the number written next to it.

One module per section (:mod:`~experiments.bench.wrappers`, ``freeze``, ``reachability``,
``report``, ``frozen``, ``callback``, ``scale``, ``sharded``, ``imports``, ``peft_llama`` for
``peft``, ``seethrough``, ``certify``, ``contracts``), over a shared timing harness
(``_timing``: every figure is the median of interleaved repeats (A, B, A, B, ...) after
warm-up, so slow phases of a shared machine hit both sides alike).
"""
