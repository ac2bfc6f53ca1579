"""Measuring one training run for the suite's report: the :class:`Recorder` callback.

Everything the report shows about a run is measured here, in the run's own process, so the same
numbers come out of an in-process run and of a run under DDP or FSDP2 in subprocesses:

* per step, the trunk's gradient after backward (the gradient the optimizer applies, averaged
  over processes under DDP; under FSDP2 each parameter's full gradient, gathered from its
  shards), saved as a reference or compared with a reference run's;
* per step, how far the trunk (parameters *and* buffers, BatchNorm statistics included) has
  drifted from where it started, the largest over every process (under FSDP2 each process
  compares the shards it holds, and its own BatchNorm buffers, which FSDP2 does not
  synchronise);
* at the first step, which parameters each loss can reach (:func:`reachable_parameters`),
  which trainable parameters the loss backpropagated cannot reach, and why
  (:func:`isolate.cutoff.cut_off_parameters` over a forward run inside
  :func:`isolate.cutoff.trace_forward`),
  and where each named loss sends its gradient, per parameter group
  (:func:`isolate.gradient_report`, drawn by the report);
* per step, the same drift per layer of the trunk (its direct children that hold
  parameters), so that a thaw shows which layer moved and when;
* with an :class:`isolate.lightning.IsolationCallback` that thaws, the step of the first thaw
  and, at the end of every step from then on, whether every process holds the same full
  parameters: each full parameter's :func:`isolate.fingerprints.fingerprint` (a DTensor's
  ``full_tensor()``), gathered from every process and compared with rank 0's;
* at the end, whether the parameters cut off at the first step still hold their values;
* with an :class:`isolate.lightning.IsolationCallback` that declares contracts, each
  contract's verdict: how often each clause was checked and found broken (its first message);
* the metrics the module logs (the logger has them too), and the accuracies that
  ``trainer.test`` measures on the test split after ``fit``;
* an exception that stopped the run, by type and message.

The result is ``run.json`` in ``output`` (plus ``trunk.pt``, the trunk's final state, full
tensors, and, with ``save_grads``, ``grads.pt``), written by the process of global rank 0 at the
end of ``fit`` and again, with the test accuracies, at the end of ``trainer.test``. Every
process takes part in the gathers and reductions before that; after an exception none is
attempted (the processes may not all have stopped at the same point), so a sharded run that
stopped keeps no ``trunk.pt``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from experiments.certifying import save_weights, write_certificate
from experiments.formats import jsonable
from isolate import gradient_report
from isolate.cutoff import cut_off_parameters, trace_forward
from isolate.drift import canonical_parameters, max_abs_diff, snapshot
from isolate.fingerprints import fingerprint
from isolate.lightning import IsolationCallback
from isolate.reachability import reachable_parameters

__all__ = ["RUN_FILE", "Recorder", "load_run"]

RUN_FILE = "run.json"
GRADS_FILE = "grads.pt"
TRUNK_FILE = "trunk.pt"


def _float(value: Any) -> float:
    return float(value.detach().cpu()) if isinstance(value, torch.Tensor) else float(value)


def _is_sharded(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards gathered (a collective: every process calls it, in
    the same order), any other tensor as it is."""
    return t.full_tensor() if _is_sharded(t) else t  # type: ignore[attr-defined]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's shard, any other tensor whole."""
    return t.to_local() if _is_sharded(t) else t  # type: ignore[attr-defined]


def _parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s named parameters, each FSDP2 temporary replaced by its sharded parameter,
    so that every read, during a step or between steps, sees the same objects."""
    return canonical_parameters(module, dict(module.named_parameters()), "Recorder")


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _max_over_processes(values: list[float]) -> list[float]:
    """Each value's maximum over the processes (a collective), or ``values`` in one process."""
    if not values or not _distributed():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def _ranks_differing(params: dict[str, torch.Tensor]) -> int:
    """How many of ``params`` differ, as full tensors, between some process and rank 0 (a
    collective: every process calls it with the same names, in the same order); 0 in one
    process. Each process sends two int64 words per parameter, its fingerprint."""
    if not _distributed():
        return 0
    words = []
    for p in params.values():
        hi, lo = divmod(fingerprint(_full(p).detach()), 2**64)
        words.append([w - 2**64 if w >= 2**63 else w for w in (hi, lo)])
    mine = torch.tensor(words, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, mine)
    differs = torch.zeros(len(words), dtype=torch.bool)
    for other in gathered[1:]:
        differs |= (other != gathered[0]).any(dim=1)
    return int(differs.sum())


def _verdicts(trainer: pl.Trainer) -> dict[str, Any]:
    """The contracts' verdicts of every IsolationCallback, by contract name."""
    found: dict[str, Any] = {}
    for cb in trainer.callbacks:
        if isinstance(cb, IsolationCallback):
            found.update(json.loads(json.dumps(cb.verdicts)))
    return found


def _thaws(trainer: pl.Trainer) -> list[IsolationCallback]:
    """The trainer's IsolationCallbacks that have a thaw schedule."""
    return [cb for cb in trainer.callbacks if isinstance(cb, IsolationCallback) and cb.spec.thaw]


class Recorder(pl.Callback):
    """Record what the suite reports about one run, and write it to ``output/run.json``.

    Args:
        output: the run's folder; ``None`` records without writing (a summary is printed at the
            end of ``fit`` either way).
        name: the run's name in the report.
        trunk: the attribute of the LightningModule whose gradients and drift are measured;
            runs whose module has no such attribute record neither.
        save_grads: keep the trunk's gradient of every step and write them to ``grads.pt``,
            the reference that other runs compare with.
        reference: a ``grads.pt`` of another run: at every step, record the max |Δ| between the
            trunk's gradient here and there.
        verbose: print the summary line at the end of ``fit``.
        progress: print a compact line after every validation (for logs, where a progress
            bar is no use).
        certify: keep the weights at the first and the last step and certify the run from
            them (:mod:`experiments.certifying`).
    """

    def __init__(
        self,
        output: str | None = None,
        name: str = "run",
        trunk: str = "trunk",
        save_grads: bool = False,
        reference: str | None = None,
        verbose: bool = True,
        progress: bool = False,
        certify: bool = False,
    ) -> None:
        super().__init__()
        self.certify = bool(certify)
        self.output = Path(output) if output else None
        self.name = name
        self.trunk_attr = trunk
        self.save_grads = save_grads
        self.reference_path = Path(reference) if reference else None
        self.verbose = verbose
        self.progress = progress
        self.record: dict[str, Any] = {}
        self._grads: list[torch.Tensor] = []
        self._reference: torch.Tensor | None = None
        self._start = 0.0
        self._audited = False
        self._tracing = contextlib.ExitStack()
        self._trace: Any = None
        self._cut_at_start: dict[str, torch.Tensor] = {}

    # -- helpers ----------------------------------------------------------------------------

    def _trunk(self, pl_module: pl.LightningModule) -> nn.Module | None:
        trunk = getattr(pl_module, self.trunk_attr, None)
        return trunk if isinstance(trunk, nn.Module) else None

    def _append(self, section: str, key: str, value: float) -> None:
        self.record[section].setdefault(key, []).append(value)

    def _metrics(self, trainer: pl.Trainer, prefix: str) -> dict[str, float]:
        return {
            key.removeprefix(prefix): _float(value)
            for key, value in trainer.callback_metrics.items()
            if key.startswith(prefix) and not key.endswith(("_step", "_epoch"))
        }

    # -- hooks ------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        self._audited = False
        self._grads = []
        self._cut_at_start = {}
        trunk = self._trunk(pl_module)
        self._snapshot = snapshot(trunk) if trunk is not None else None
        if self.certify and self.output is not None and trainer.world_size == 1:
            save_weights(pl_module, self.output / "first.pt")
        self._names = _kinds(trunk) if trunk is not None else {}
        self._layers = _layers(trunk) if trunk is not None else {}
        self._batch_step = 0
        self._reference = None
        if self.reference_path is not None and trunk is not None:
            self._reference = torch.load(self.reference_path, map_location="cpu")
        self.record = {
            "name": self.name,
            "status": "running",
            "model": type(pl_module).__name__,
            "hparams": jsonable(dict(pl_module.hparams)),
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "max_steps": trainer.max_steps,
            "max_epochs": trainer.max_epochs,
            "seed": _seed(),
            "train": {"step": []},
            "val": {"step": []},
            "grad_delta": [] if self._reference is not None else None,
            "grad_norm": [],
            "drift": {kind: [] for kind in self._names},
            "drift_layers": {layer: [] for layer in self._layers},
            "audit": {},
            "trunk_tensors": (
                {
                    "parameters": len(list(trunk.parameters())),
                    "buffers": len(list(trunk.buffers())),
                    # FSDP2 shards (DTensor): 0 unless the module sharded itself.
                    "sharded": sum(_is_sharded(p) for p in _parameters(trunk).values()),
                }
                if trunk is not None
                else None
            ),
        }
        if _thaws(trainer):
            self.record["thaw"] = {
                "step": None,
                "world_size": trainer.world_size,
                "parameters": len(_parameters(pl_module)),
                "checked_steps": [],
                "differing": [],
            }
        datamodule = trainer.datamodule
        if datamodule is not None:
            self.record["data"] = {
                "note": getattr(datamodule, "source_note", ""),
                "split": getattr(datamodule, "split_info", {}),
            }

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_step = trainer.global_step
        # The first forward runs traced, so a cut-off parameter comes with its reason; the
        # hooks come off right after (on_before_backward), or when the step fails.
        if not self._audited and self._trace is None:
            self._trace = self._tracing.enter_context(trace_forward(pl_module))

    def _stop_trace(self) -> Any:
        trace, self._trace = self._trace, None
        self._tracing.close()
        return trace

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._audited:
            return
        self._audited = True
        trace = self._stop_trace()
        named: dict[str, torch.Tensor] = dict(getattr(pl_module, "losses", {}) or {})
        losses = {**named, "total": loss}
        groups = _groups(pl_module)
        audit = {}
        for name, value in losses.items():
            reached = set(reachable_parameters(value, pl_module))
            audit[name] = {
                group: [len(reached & set(members)), len(members)]
                for group, members in groups.items()
            }
        self.record["audit"] = audit
        # The loss backpropagated: what it cannot reach gets no gradient at all.
        cut = cut_off_parameters(loss, pl_module, trace=trace)
        self.record["cut_off"] = {
            "step": trainer.global_step,
            "trainable": cut.trainable,
            "parameters": dict(cut.parameters),
        }
        # This process's shard of each (the whole tensor without sharding); compared at the
        # end with the same shard, and the verdict is reduced over the processes.
        self._cut_at_start = {
            name: _local(p).detach().clone()
            for name, p in _parameters(pl_module).items()
            if name in cut.parameters
        }
        if named:
            where = _figure_groups(pl_module, self.trunk_attr, groups)
            self.record["gradients"] = gradient_report(named, pl_module, groups=where).to_dict()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trunk = self._trunk(pl_module)
        if trunk is None:
            return
        params = list(_parameters(trunk).values())
        if not any(p.grad is not None for p in params):
            self.record["grad_norm"].append(None)
            if self.record["grad_delta"] is not None:
                self.record["grad_delta"].append(None)
            return
        # Under FSDP2 each grad is this process's shard of the averaged gradient: one gather
        # per parameter gives the whole gradient, the same on every process.
        flat = torch.cat(
            [
                (
                    _full(p.grad)
                    if p.grad is not None
                    else torch.zeros(p.shape, dtype=p.dtype, device=_local(p).device)
                )
                .detach()
                .reshape(-1)
                .cpu()
                for p in params
            ]
        )
        self.record["grad_norm"].append(float(flat.double().norm()))
        if self.save_grads:
            self._grads.append(flat.clone())
        if self._reference is not None:
            step = len(self.record["grad_norm"]) - 1
            delta = (
                max_abs_diff(self._reference[step], flat) if step < len(self._reference) else None
            )
            self.record["grad_delta"].append(delta)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.record["train"]["step"].append(trainer.global_step)
        contracts = _verdicts(trainer)
        if contracts:
            self.record["contracts"] = contracts
        for key, value in self._metrics(trainer, "train/").items():
            self._append("train", key, value)
        if self._snapshot is not None:
            moved = self._snapshot.changed()
            kinds, layers = list(self._names), list(self._layers)
            values = [
                max((d for n, d in moved.items() if n in names), default=0.0)
                for names in [*self._names.values(), *self._layers.values()]
            ]
            values = _max_over_processes(values)  # one reduction for both
            for kind, value in zip(kinds, values[: len(kinds)], strict=True):
                self.record["drift"][kind].append(value)
            for layer, value in zip(layers, values[len(kinds) :], strict=True):
                self.record["drift_layers"][layer].append(value)
        thaw = self.record.get("thaw")
        if thaw is not None:
            if thaw["step"] is None and any(
                cb.handle and cb.handle.thawed for cb in _thaws(trainer)
            ):
                thaw["step"] = self._batch_step  # the step the thaw came before
            if thaw["step"] is not None:
                thaw["checked_steps"].append(self._batch_step)
                thaw["differing"].append(_ranks_differing(_parameters(pl_module)))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self.record:
            return
        self.record["val"]["step"].append(trainer.global_step)
        metrics = self._metrics(trainer, "val/")
        for key, value in metrics.items():
            self._append("val", key, value)
        if self.progress and trainer.is_global_zero:
            total = trainer.estimated_stepping_batches
            shown = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if "acc" in k)
            print(f"    {self.name} step {trainer.global_step}/{total}: val {shown}", flush=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["status"] = "ok"
        if self.certify and self.output is not None and trainer.is_global_zero:
            if trainer.world_size == 1:
                save_weights(pl_module, self.output / "last.pt")
            self.record["certificate"] = write_certificate(trainer, self.output)
        self._finish(trainer, pl_module)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.record.get("status") != "ok":  # a test without a fit: nothing to add to
            return
        metrics = self._metrics(trainer, "test/")
        self.record["test"] = {k: v for k, v in metrics.items() if "acc" in k}
        datamodule = trainer.datamodule
        if datamodule is not None and hasattr(pl_module, "chance"):
            self.record["chance"] = pl_module.chance(datamodule.test_dataloader())
        if trainer.is_global_zero and self.output is not None:
            self._write_record(self.output)
        if self.verbose and trainer.is_global_zero:
            print(summary_line(self.record), flush=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stop_trace()  # a first step that failed before backward
        if not self.record:
            return
        self.record["status"] = "error"
        self.record["error"] = {"type": type(exception).__name__, "message": str(exception)}
        self._finish(trainer, pl_module)

    # -- the end ----------------------------------------------------------------------------

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_trace()
        record = self.record
        contracts = _verdicts(trainer)  # the checks at the end of training count too
        if contracts:
            record["contracts"] = contracts
        # Collectives only after a fit that ended normally, which every process reaches.
        together = record["status"] == "ok" or not _distributed()
        if "cut_off" in record:
            now = _parameters(pl_module)
            moved = [
                float(not torch.equal(start, _local(now[name]).detach()))
                for name, start in self._cut_at_start.items()
            ]
            if together:
                moved = _max_over_processes(moved)
            record["cut_off"]["changed"] = [
                name for name, flag in zip(self._cut_at_start, moved, strict=True) if flag
            ]
        record["seconds"] = time.perf_counter() - self._start
        record["steps"] = trainer.global_step
        if self._snapshot is not None:
            changed = self._snapshot.changed()
            kinds = list(self._names)
            values = [
                max((d for n, d in changed.items() if n in self._names[kind]), default=0.0)
                for kind in kinds
            ]
            if together:
                values = _max_over_processes(values)
            record["drift_final"] = dict(zip(kinds, values, strict=True))
            record["drift_final"]["moved"] = changed
            record["drift_final"]["checked"] = list(self._snapshot.names)
        trunk = self._trunk(pl_module)
        state = None
        if trunk is not None and together:
            state = {k: _full(v).detach().cpu().clone() for k, v in trunk.state_dict().items()}
        # The snapshot's and the start values' references would keep FSDP2's sharded parameters
        # from being swapped when the strategy moves the model again (trainer.test).
        self._snapshot, self._cut_at_start = None, {}
        if trainer.is_global_zero and self.output is not None:
            self._write(self.output, state)
        if self.verbose and trainer.is_global_zero and record["status"] != "ok":
            print(summary_line(record), flush=True)

    def _write(self, output: Path, state: dict[str, torch.Tensor] | None) -> None:
        output.mkdir(parents=True, exist_ok=True)
        if state is not None:
            torch.save(state, output / TRUNK_FILE)
        if self.save_grads and self._grads:
            torch.save(torch.stack(self._grads), output / GRADS_FILE)
        self._write_record(output)

    def _write_record(self, output: Path) -> None:
        output.mkdir(parents=True, exist_ok=True)
        path = output / RUN_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(jsonable(self.record), indent=1))
        tmp.replace(path)


def summary_line(record: dict[str, Any]) -> str:
    """One line on how a run ended: status, accuracies, gradient delta, drift."""
    parts = [f"{record.get('name', 'run')}:"]
    if record.get("status") == "error":
        error = record.get("error", {})
        message = str(error.get("message", "")).split(";")[0]
        return " ".join([*parts, f"stopped by {error.get('type')}: {message}"])
    test = record.get("test") or {}
    parts += [
        f"{key.removeprefix('acc/').removesuffix('_acc')} acc {value:.3f}"
        for key, value in test.items()
    ]
    deltas = [d for d in record.get("grad_delta") or [] if d is not None]
    if deltas:
        parts.append(f"trunk grad max|Δ| vs reference {max(deltas):.3g} over {len(deltas)} steps")
    drift = record.get("drift_final")
    if drift is not None:
        parts.append(
            "trunk drift at the end: "
            + ", ".join(f"{kind} {drift[kind]:.3g}" for kind in _KINDS if kind in drift)
        )
    parts.append(f"({record.get('seconds', 0.0):.1f} s)")
    return " ".join(parts)


def load_run(folder: Path) -> dict[str, Any]:
    """The ``run.json`` a :class:`Recorder` wrote into ``folder``."""
    return json.loads((folder / RUN_FILE).read_text())


_KINDS = ("parameters", "buffers", "counters")


def _kinds(trunk: nn.Module) -> dict[str, set[str]]:
    """Names of the trunk's parameters, floating-point buffers (BatchNorm running statistics)
    and integer buffers (``num_batches_tracked``), which drift on different scales."""
    buffers = dict(trunk.named_buffers())
    return {
        "parameters": {n for n, _ in trunk.named_parameters()},
        "buffers": {n for n, b in buffers.items() if b.is_floating_point()},
        "counters": {n for n, b in buffers.items() if not b.is_floating_point()},
    }


def _layers(trunk: nn.Module) -> dict[str, set[str]]:
    """Names of the trunk's parameters by the direct child that holds them (``"9"`` for
    ``9.weight``)."""
    layers: dict[str, set[str]] = {}
    for name, _ in trunk.named_parameters():
        layers.setdefault(name.partition(".")[0], set()).add(name)
    return layers


def _groups(pl_module: nn.Module) -> dict[str, list[str]]:
    """Parameter names by owner: each direct child, and each branch of a ``branches`` dict."""
    groups: dict[str, list[str]] = {}
    for name, _ in pl_module.named_parameters():
        head, _, rest = name.partition(".")
        key = f"{head}.{rest.partition('.')[0]}" if head == "branches" else head
        groups.setdefault(key, []).append(name)
    return groups


def _figure_groups(
    pl_module: nn.Module, trunk: str, groups: dict[str, list[str]]
) -> dict[str, str]:
    """The groups of the gradient figure: those of the audit, the trunk's split into its
    layers that hold parameters, so that a layer no loss reaches shows as one."""
    where: dict[str, str] = {}
    for group in groups:
        module = getattr(pl_module, group, None) if group == trunk else None
        if isinstance(module, nn.Module):
            for name, child in module.named_children():
                if any(True for _ in child.parameters()):
                    where[f"{group}.{name}"] = f"{group}.{name}"
        else:
            where[group] = group
    return where


def _seed() -> int | None:
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value is not None else None
