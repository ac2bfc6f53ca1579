"""What verify's drift check watches as the handle changes: what is frozen now (a thaw takes its
group out of the watch, nothing else), by fingerprint unless told otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isolate import IsolationSpec, Thaw
from isolate.errors import DriftError
from isolate.spec.handle import IsolationHandle
from isolate.spec.plan import resolve

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 1))


def values(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(prefix)}


def test_after_a_thaw_the_drift_check_watches_what_is_still_frozen() -> None:
    model = stack()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    handle = IsolationSpec(freeze=["0", "1"], thaw=[Thaw("0", step=1)]).apply(model, opt)
    first, second = values(model, "0."), values(model, "1.")
    watched = []
    try:
        for step in range(4):
            handle.step(epoch=0, step=step)
            loss = model(torch.randn(4, 2)).square().mean()
            found = handle.verify(total=loss)  # the thawed group moves from step 1 on
            watched.append(found.drift)
            assert found.violations == ()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert watched == [4, 2, 2, 2]  # both layers' weight and bias, then the second's
        # Brute force: the thawed layer trained, the frozen one is bitwise where it was.
        assert all(not torch.equal(p, first[n]) for n, p in values(model, "0.").items())
        assert all(torch.equal(p, second[n]) for n, p in values(model, "1.").items())
        with torch.no_grad():
            model[1].weight[0, 0] += 1e-3  # what is still frozen is still watched
        with pytest.raises(DriftError, match=r"frozen tensors moved .*: \['1\.weight'\]"):
            handle.verify(total=model(torch.randn(4, 2)).sum())
    finally:
        handle.restore()


def test_a_handle_watches_by_fingerprint_unless_told_otherwise() -> None:
    spec = IsolationSpec(freeze=["0"])
    for handle, drift in (
        (IsolationHandle(resolve(spec, stack())), "fingerprint"),  # built by hand
        (spec.apply(stack()), "fingerprint"),
        (spec.apply(stack(), drift="copy"), "copy"),
    ):
        assert handle.drift == drift
        if not handle.active:
            handle.start()
        try:
            with torch.no_grad():
                handle.plan.model[0].bias[0] += 1.0
            with pytest.raises(DriftError) as caught:
                handle.verify(total=handle.plan.model(torch.randn(4, 2)).sum())
            # A fingerprint cannot say by how much; a copy can.
            assert ("fingerprints only" in str(caught.value)) == (drift == "fingerprint")
        finally:
            handle.restore()
