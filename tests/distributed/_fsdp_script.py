"""Two CPU processes (gloo) running ``fully_shard`` (FSDP2) models for
``tests/distributed/test_fsdp.py``.

Usage: ``python tests/distributed/_fsdp_script.py MODE OUT_DIR``. It spawns 2 processes (4 for
``hsdp``) on a free port; each writes ``OUT_DIR/<mode>-rank<r>.json`` with what it measured.

Modes:

* ``audits``: the audits on a sharded model against the same model unsharded, on the same
  batch, and the raw graph walk (the negative control: what an audit that does not map
  the shards would see);
* ``engine``: an IsolationSpec applied to a sharded model and trained with AdamW (weight
  decay) and with SGD (momentum): full-tensor fingerprints per step, thaw bookkeeping, and
  the naive thaw that is lost when a unit stays unsharded;
* ``hsdp``: the rank check on a 2 x 2 (replicate x shard) mesh of 4 processes;
* ``checkpointed``: a sharded layer behind a reentrant checkpoint: the walk's re-run (fake
  or real, recorded) against a real backward, and the gradients of that backward against
  the same model unsharded.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import isolate
import isolate.gradients
import isolate.reachability
from isolate import _checkpointing as checkpointing
from isolate import _sharding as sharding
from isolate.drift import fingerprint
from isolate.reachability import walk
from isolate.spec.ranks import check_ranks
from tests.distributed._spawn import Mode, batch, full, spawn


class Net(nn.Module):
    def __init__(self, *, bn: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(4, 8)]
        if bn:
            layers.append(nn.BatchNorm1d(8))
        layers += [nn.ReLU(), nn.Linear(8, 8), nn.ReLU()]
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 3)
        self.cut = True  # whether the aux head sees detached features (audits only)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        return self.head(features), self.aux(features.detach() if self.cut else features)


def shard(model: Net) -> Net:
    for layer in model.trunk:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model.aux)
    fully_shard(model)
    return model


def prints(model: nn.Module) -> dict[str, str]:
    """Fingerprints of every full parameter and buffer (gathered one tensor at a time)."""
    out = {n: f"{fingerprint(full(p.detach())):032x}" for n, p in model.named_parameters()}
    out.update({n: f"{fingerprint(b):032x}" for n, b in model.named_buffers()})
    return out


def raises(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as error:  # the test asserts on the type and message
        return f"{type(error).__name__}: {error}"
    return ""


def audits() -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    ref = Net()
    model = shard(copy.deepcopy(ref))
    x = batch()
    for cut in (False, True):
        model.cut = ref.cut = cut
        main, aux = model(x)
        ref_main, ref_aux = ref(x)
        loss, ref_loss = aux.sum(), ref_aux.sum()
        key = "cut" if cut else "joined"
        out[f"{key}/reach"] = isolate.reachability.reachable_parameters(aux.sum(), model)
        out[f"{key}/reach_ref"] = isolate.reachability.reachable_parameters(ref_aux.sum(), ref)
        # the walk alone: what an audit that does not map the shards sees
        found = walk([aux.sum()], "raw")
        out[f"{key}/raw_reach"] = [n for n, p in model.named_parameters() if id(p) in found.leaves]
        out[f"{key}/raw_trunk_hits"] = [
            n for n, p in model.trunk.named_parameters() if id(p) in found.leaves
        ]
        out[f"{key}/isolated"] = raises(
            lambda loss=loss: isolate.assert_isolated(loss, model.trunk[2], model=model)
        )
        out[f"{key}/isolated_no_model"] = raises(
            lambda loss=loss: isolate.assert_isolated(loss, model.trunk)
        )
        out[f"{key}/isolated_ref"] = raises(
            lambda loss=ref_loss: isolate.assert_isolated(loss, ref.trunk[2], model=ref)
        )
        groups = {"trunk": "trunk", "head": "head", "aux": "aux"}
        report = isolate.gradient_report(
            {"main": main.sum(), "aux": aux.sum()}, model, groups=groups
        )
        ref_report = isolate.gradient_report(
            {"main": ref_main.sum(), "aux": ref_aux.sum()}, ref, groups=groups
        )
        out[f"{key}/report"] = report.to_dict()
        out[f"{key}/report_ref"] = ref_report.to_dict()
        inv = isolate.gradients.gradient_invariance(
            main.sum(), main.sum() + aux.sum(), model.trunk, model=model
        )
        ref_inv = isolate.gradients.gradient_invariance(
            ref_main.sum(), ref_main.sum() + ref_aux.sum(), ref.trunk, model=ref
        )
        out[f"{key}/invariance"] = dict(inv.deltas)
        out[f"{key}/invariance_ref"] = dict(ref_inv.deltas)
        # With the FSDP2 mapping switched off (an FSDP version isolate does not know), the
        # generic rule still sees sharded parameters stood for by foreign leaves: refuse.
        saved = sharding._fsdp_units
        sharding._fsdp_units = lambda modules: iter(())  # type: ignore[assignment]
        try:
            out[f"{key}/unmapped"] = raises(
                lambda loss=loss: isolate.reachability.reachable_parameters(loss, model)
            )
            out[f"{key}/unmapped_report"] = raises(
                lambda loss=loss: isolate.gradient_report({"aux": loss}, model)
            )
        finally:
            sharding._fsdp_units = saved  # type: ignore[assignment]
        (main.sum() + aux.sum()).backward()
        model.zero_grad()
    # snapshot: the registered objects change between forward and backward; the shards do not.
    model.cut = True
    snap = isolate.snapshot(model, drift="fingerprint")
    main, aux = model(x)
    out["snapshot/after_forward"] = sorted(snap.changed())
    out["snapshot/replaced_after_forward"] = list(snap.replaced())
    (main.sum() + aux.sum()).backward()
    torch.optim.SGD(model.head.parameters(), lr=0.1).step()
    model.zero_grad()
    out["snapshot/after_head_step"] = sorted(snap.changed())
    return out


def engine_run(make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = shard(Net(bn=True))  # trunk: 0 Linear, 1 BatchNorm1d, 2 ReLU, 3 Linear, 4 ReLU
    opt = make_opt(list(model.parameters()))
    spec = isolate.IsolationSpec(
        freeze=["trunk"], detach=["aux"], bn="eval", thaw=[isolate.Thaw("trunk.3", step=2)]
    )
    handle = spec.apply(model, optimizer=opt)
    rec: dict[str, Any] = {"prints": [prints(model)], "groups": [], "verify": [], "thawed": []}
    for step in range(4):
        rec["thawed"].append(handle.step(epoch=0, step=step))
        rec["groups"].append([len(g["params"]) for g in opt.param_groups])
        main, aux = model(batch(step))
        v = handle.verify({"aux": aux.sum()}, checks=("losses",))
        (main.sum() + aux.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # zero grads: the trap for frozen parameters
        v2 = handle.verify(checks=("drift", "flags", "optimizers", "ranks"))
        rec["verify"].append([dict(v.losses), v2.ranks, list(v2.violations)])
        rec["prints"].append(prints(model))
    thawed_group = opt.param_groups[-1]["params"]
    rec["thawed_group_is_dtensors"] = [
        type(p).__name__ == "DTensor" and any(p is q for q in model.trunk[3].parameters())
        for p in thawed_group
    ]
    rec["ids_in_optimizer"] = sum(len(g["params"]) for g in opt.param_groups)
    rec["unique_ids_in_optimizer"] = len({id(p) for g in opt.param_groups for p in g["params"]})
    handle.restore()
    rec["requires_grad_after_restore"] = [p.requires_grad for p in model.parameters()]
    rec["aux_type_after_restore"] = type(model.aux).__name__
    opt.zero_grad(set_to_none=True)  # no gradient left on a DTensor when the group goes
    return rec


def naive_thaw(use_isolate: bool) -> list[bool]:
    """Whether a head frozen while its unit stayed unsharded learns at each of the two steps
    after a thaw (the first step counts: a flag flipped while the unit is unsharded reaches
    its temporaries only at the next all-gather, one step late)."""
    torch.manual_seed(0)
    model = shard(Net())
    opt = torch.optim.SGD(
        [p for n, p in model.named_parameters() if not n.startswith("head")], lr=0.1
    )
    handle = None
    if use_isolate:
        handle = isolate.IsolationSpec(
            freeze=["head"], thaw=[isolate.Thaw("head", step=1, lr=0.1)]
        ).apply(model, optimizer=opt)
    else:
        model.head.requires_grad_(False)
    with torch.no_grad():  # a validation pass: the root unit stays unsharded after it
        model(batch())
    if handle is not None:
        handle.step(epoch=0, step=1)
    else:  # the obvious thaw, on whatever objects the module holds now
        model.head.requires_grad_(True)
        opt.add_param_group({"params": list(model.head.parameters())})
    moved = []
    for step in range(2):
        before = full(model.head.weight.detach()).clone()
        main, aux = model(batch(step))
        (main.sum() + aux.sum()).backward()
        opt.step()
        opt.zero_grad()
        moved.append(not torch.equal(before, full(model.head.weight.detach())))
    if handle is not None:
        handle.restore()
    return moved


def engine() -> dict[str, Any]:
    out: dict[str, Any] = {
        "adamw": engine_run(lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)),
        "sgd": engine_run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)),
        "naive_thaw_moves": naive_thaw(False),
        "isolate_thaw_moves": naive_thaw(True),
    }
    # The rank check compares fingerprints: a one-bit difference on one rank is caught, and
    # FSDP shards (different on every rank by design) are not compared with each other.
    t = torch.arange(8, dtype=torch.float32)
    if dist.get_rank() == 1:
        t.view(torch.int32)[3] ^= 1
    model = shard(Net())
    sharded = {n: p for n, p in model.named_parameters()}
    out["ranks_plain"] = [str(e) for e in check_ranks({"t": t}, "now", "test")]
    out["ranks_sharded"] = [str(e) for e in check_ranks(sharded, "now", "test")]
    out["units_settled"] = sharding.settle(model)
    out["one_verdict"] = one_verdict()
    return out


def one_verdict() -> dict[str, list[str]]:
    """A frozen shard moved on its owner (rank 1) only: with "drift" alone only rank 1 sees
    it; with "ranks" too every rank raises the same DriftError, so no rank is left waiting in
    the next collective while another one stopped."""
    model = shard(Net())
    handle = isolate.IsolationSpec(freeze=["trunk.0"]).apply(model)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.trunk[0].weight.to_local().view(-1)[0] += 1e-3
    out: dict[str, list[str]] = {}
    for name, checks in (("alone", ("drift",)), ("with_ranks", ("drift", "ranks"))):
        try:
            handle.verify(checks=checks)
            out[name] = []
        except isolate.IsolationError as error:
            out[name] = [type(error).__name__, str(error)]
        if name == "alone":
            handle.restore()  # watch again from the moved values on both ranks...
            handle = isolate.IsolationSpec(freeze=["trunk.0"]).apply(model)
            if dist.get_rank() == 1:  # ...and move the shard on rank 1 again
                with torch.no_grad():
                    model.trunk[0].weight.to_local().view(-1)[0] += 1e-3
    if dist.get_rank() == 1:  # a check reports a move once: move it again
        with torch.no_grad():
            model.trunk[0].weight.to_local().view(-1)[0] += 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", isolate.IsolationWarning)
        warned = handle.verify(checks=("drift", "ranks"), on_violation="warn")
    out["warned"] = list(warned.violations)
    handle.restore()
    return out


def hsdp() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Net()
    for module in (model.trunk[0], model.trunk[2], model.aux, model):
        fully_shard(module, mesh=mesh)
    spec = isolate.IsolationSpec(freeze=["trunk.0"], thaw=[isolate.Thaw("trunk.0", step=1)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    handle = spec.apply(model, optimizer=opt)
    out: dict[str, Any] = {"violations": [], "prints": []}
    for step in range(3):
        handle.step(epoch=0, step=step)
        main, aux = model(batch(step % 2 + 10 * (dist.get_rank() // 2)))
        (main.sum() + aux.sum()).backward()
        opt.step()
        opt.zero_grad()
        v = handle.verify(checks=("drift", "flags", "optimizers", "ranks"), on_violation="warn")
        out["violations"].append(list(v.violations))
        out["prints"].append(prints(model))
    # Corrupt one replica's shard by one bit: the replicas of that shard disagree.
    if dist.get_rank() == 3:
        local = model.head.weight.to_local()
        with torch.no_grad():
            local.view(torch.int32).view(-1)[0] ^= 1
    out["corrupted"] = [str(e) for e in check_ranks(dict(model.named_parameters()), "now", "t")]
    handle.restore()
    return out


def fsdp1() -> dict[str, Any]:
    """FSDP1 wrapped by hand on the CPU: a mixed unit warns, a thaw inside it matches the
    unsharded reference, audits refuse the flat leaves; use_orig_params=False is refused."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out: dict[str, Any] = {}
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    wrapped = FSDP(model, device_id=cpu, use_orig_params=True)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    spec = isolate.IsolationSpec(
        freeze=["_fsdp_wrapped_module.0"],
        thaw=[isolate.Thaw("_fsdp_wrapped_module.0", step=1)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", isolate.IsolationWarning)
        handle = spec.apply(wrapped, optimizer=opt)
    out["warnings"] = [str(w.message) for w in caught if "FSDP1" in str(w.message)]
    ref[0].requires_grad_(False)
    ref_opt = torch.optim.SGD(
        [p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    for step in range(3):
        handle.step(epoch=0, step=step)
        if step == 1:
            ref[0].requires_grad_(True)
            ref_opt.add_param_group({"params": list(ref[0].parameters())})
        x = xs[dist.get_rank()]
        loss = wrapped(x).sum()
        out.setdefault(
            "audit",
            raises(lambda loss=loss: isolate.reachability.reachable_parameters(loss, wrapped)),
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(xx).sum() for xx in xs) / 2).backward()  # FSDP averages over the 2 ranks
        ref_opt.step()
        ref_opt.zero_grad()
    with FSDP.summon_full_params(wrapped):
        got = {
            n.removeprefix("_fsdp_wrapped_module."): p.detach().clone()
            for n, p in wrapped.named_parameters()
        }
    out["matches_reference"] = {
        n: bool(torch.allclose(got[n], p.detach(), atol=1e-6)) for n, p in ref.named_parameters()
    }
    handle.restore()
    wrapped.zero_grad()
    flat = FSDP(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        device_id=cpu,
        use_orig_params=False,
    )
    out["orig_params_false"] = raises(lambda: isolate.IsolationSpec(freeze=["0"]).apply(flat))
    return out


def tp() -> dict[str, Any]:
    """Tensor parallelism (DTensor parameters that are the graph's leaves themselves)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 2))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = batch()
    reach = isolate.reachability.reachable_parameters
    out: dict[str, Any] = {"reach": reach(model(x).sum(), model)}
    cut = model[3](model[2](model[1](model[0](x))).detach()).sum()
    out["cut_reach"] = isolate.reachability.reachable_parameters(cut, model)
    out["isolated"] = raises(lambda: isolate.assert_isolated(cut, model[0], model=model))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    spec = isolate.IsolationSpec(freeze=["0"], thaw=[isolate.Thaw("0", step=1)])
    handle = spec.apply(model, optimizer=opt)
    out["prints"], out["violations"] = [], []
    for step in range(3):
        handle.step(epoch=0, step=step)
        model(batch(step)).sum().backward()
        opt.step()
        opt.zero_grad()
        v = handle.verify(checks=("drift", "flags", "optimizers", "ranks"), on_violation="warn")
        out["violations"].append(list(v.violations))
        out["prints"].append(prints(model))
    out["groups"] = [len(g["params"]) for g in opt.param_groups]
    handle.restore()
    return out


class Checkpointed(nn.Module):
    """in -> [reentrant checkpoint: block] -> head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.inp(x), use_reentrant=True)
        loss: torch.Tensor = self.head(h.relu()).sum()
        return loss


def checkpointed() -> dict[str, Any]:
    ref = Checkpointed()
    model = copy.deepcopy(ref)
    fully_shard(model.block)
    fully_shard(model)
    fake: list[bool] = []
    structure = checkpointing._rerun_structure

    def recorded(node: Any, caller: str) -> Any:
        found = structure(node, caller)
        fake.append(found is not None)
        return found

    checkpointing._rerun_structure = recorded
    try:
        x = batch()
        loss = model(x)
        reached = isolate.reachability.reachable_parameters(loss, model)
        loss.backward()
    finally:
        checkpointing._rerun_structure = structure
    for rank in range(dist.get_world_size()):  # FSDP averages the ranks' gradients
        (ref(batch(rank=rank)) / dist.get_world_size()).backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return {
        "reached": list(reached),
        "real": list(grads),
        "fake": fake,
        "grads equal unsharded": all(
            torch.allclose(grads[n], p.grad) for n, p in ref.named_parameters() if n in grads
        ),
    }


MODES: dict[str, Mode] = {
    "checkpointed": checkpointed,
    "audits": audits,
    "engine": engine,
    "hsdp": hsdp,
    "fsdp1": fsdp1,
    "tp": tp,
}


def main() -> None:
    mode = sys.argv[1]
    spawn(MODES, mode, sys.argv[2], world=4 if mode == "hsdp" else 2)


if __name__ == "__main__":
    main()
