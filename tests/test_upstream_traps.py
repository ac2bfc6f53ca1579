"""The traps of torch that isolate exists for, pinned as they are today.

Nothing here calls isolate. Each test documents one behaviour of torch that makes gradient
isolation fail quietly, and that isolate's docs (the ``Note:`` sections of
``isolate.stop_gradient``, ``isolate.Detached``, ``isolate.clone``) and its guards rely on.

If a test here fails, the trap is gone (or changed) upstream: isolate is not broken. Read the
failure as "update the docs": rewrite the Note that describes the trap, and check whether the
guard for it is still needed. Run them alone with ``pytest -m upstream_trap``; their failures
carry that reminder (see ``pytest_runtest_makereport`` in ``tests/conftest.py``).

isolate's answers to these traps are tested beside the features that give them:
``tests/toolkit/test_detaching.py`` (the in-place guard, ``stop_gradient``) and
``tests/toolkit/test_cloning.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.upstream_trap

SIGMOID_GRAD = torch.tensor([0.1966, 0.1050, 0.0452])


def _a() -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 3.0], requires_grad=True)


def test_detaching_an_output_and_leaving_it_alone_does_not_change_backward() -> None:
    """Documents: ``t.detach()`` returns a tensor without ``grad_fn`` that does not require
    grad, and taking it does not change the backward of ``t``. If this fails, the trap is gone
    upstream: update the docs of ``isolate.stop_gradient``."""
    a = _a()
    out = a.sigmoid()
    side = out.detach()
    assert side.grad_fn is None and not side.requires_grad
    out.sum().backward()
    assert a.grad is not None
    torch.testing.assert_close(a.grad, SIGMOID_GRAD, atol=1e-4, rtol=0)


def test_backward_from_a_detached_tensor_raises() -> None:
    """Documents: a backward from a detached tensor raises "does not require grad". If this
    fails, the trap is gone upstream: update the docs."""
    side = _a().sigmoid().detach()
    with pytest.raises(RuntimeError, match="does not require grad"):
        side.sum().backward()


def test_requires_grad_on_a_detached_tensor_does_not_reconnect_it() -> None:
    """Documents: ``detach().requires_grad_(True)`` makes a new leaf; it does not reconnect
    the tensor to the graph it came from. If this fails, the trap is gone upstream: update the
    Note of ``isolate.stop_gradient``."""
    a = _a()
    side = a.sigmoid().detach().requires_grad_(True)
    side.sum().backward()
    assert a.grad is None
    assert side.grad is not None and side.is_leaf


def test_a_detached_tensor_shares_storage_and_an_edit_breaks_the_main_backward() -> None:
    """Documents: ``detach()`` shares storage, so zeroing the detached copy zeroes the main
    branch's values, and a backward that saved them (sigmoid) raises "modified by an inplace
    operation". If this fails, the trap is gone upstream: update the Notes of
    ``isolate.stop_gradient`` and ``isolate.Detached``."""
    a = _a()
    out = a.sigmoid()
    out.detach().zero_()
    assert torch.equal(out, torch.zeros(3))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_an_edit_through_a_detached_tensor_goes_unnoticed_when_backward_saved_nothing() -> None:
    """Documents the silent case: ``AddBackward`` saves no input, so autograd never notices
    that a detached alias was edited, and the main loss trains on corrupted values without an
    error. This is why ``isolate.Detached`` compares version counters itself. If this fails,
    the trap is gone upstream: update the Note of ``isolate.Detached``."""
    a = _a()
    features = a * 1.0
    main = features + 1.0
    features.detach().zero_()
    main.sum().backward()  # no error
    assert torch.equal(features, torch.zeros(3))
    assert torch.equal(a.grad, torch.ones(3))  # type: ignore[arg-type]


def test_detach_in_place_turns_the_tensor_into_a_leaf_for_good() -> None:
    """Documents: ``t.detach_()`` makes ``t`` itself a leaf; re-enabling grad on it does not
    reconnect it. If this fails, the trap is gone upstream: update the docs."""
    a = _a()
    out = a.sigmoid()
    out.detach_()
    assert out.is_leaf and out.grad_fn is None and not out.requires_grad
    out.requires_grad_(True)
    (out * 2).sum().backward()
    assert a.grad is None


def test_detach_in_place_refuses_views() -> None:
    """Documents: ``detach_()`` on a view raises. If this fails, the trap is gone upstream:
    update the docs."""
    base = _a() * 1.0
    view = base[:2]
    with pytest.raises(RuntimeError, match="view"):
        view.detach_()


def test_gradient_flows_back_through_clone_and_accumulates_on_the_source() -> None:
    """Documents: ``clone()`` has its own memory but stays in the graph; gradient through it
    accumulates onto the source. ``isolate.Cloned`` relies on it. If this fails, the trap is
    gone upstream: update the docs of ``isolate.clone``."""
    a = _a()
    out = a.sigmoid()
    copy = out.clone()
    assert copy.grad_fn is not None and copy.data_ptr() != out.data_ptr()
    (out.sum() + copy.sum()).backward()
    assert a.grad is not None
    torch.testing.assert_close(a.grad, 2 * SIGMOID_GRAD, atol=2e-4, rtol=0)


def test_batchnorm_running_statistics_ignore_requires_grad() -> None:
    """Documents: BatchNorm updates its running statistics in train mode even when all its
    parameters have ``requires_grad=False`` and no gradient is computed. This is why
    ``isolate.freeze`` holds BatchNorm in eval mode by default. If this fails, the trap is
    gone upstream: update the Note of ``isolate.freeze``."""
    bn = torch.nn.BatchNorm1d(2).requires_grad_(False)
    with torch.no_grad():
        bn(torch.randn(8, 2) + 3.0)
    assert int(bn.num_batches_tracked) == 1
    assert bool((bn.running_mean != 0).all())


def test_a_parent_train_call_undoes_a_child_eval_call() -> None:
    """Documents: ``parent.train()`` sets ``training=True`` on every child, a child's earlier
    ``.eval()`` included. This is why ``isolate.freeze(bn="eval")`` enforces the mode in a
    forward pre-hook. If this fails, the trap is gone upstream: update the Note of
    ``isolate.freeze``."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model[1].eval()
    model.train()
    assert model[1].training


def test_optimizers_move_frozen_parameters_whose_grad_is_a_zero_tensor() -> None:
    """Documents: SGD with weight decay (and momentum, AdamW, ...) moves a parameter with
    ``requires_grad=False`` when its ``.grad`` is a zero tensor rather than ``None``. This is
    why ``isolate.freeze`` drops ``.grad``. If this fails, the trap is gone upstream: update
    the Notes of ``isolate.freeze`` and ``isolate.snapshot``."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, weight_decay=0.5)
    p.requires_grad_(False)
    p.grad = torch.zeros(2)
    opt.step()
    assert torch.equal(p.detach(), torch.full((2,), 0.95))
    p.grad = None
    opt.step()
    assert torch.equal(p.detach(), torch.full((2,), 0.95))  # None: skipped
