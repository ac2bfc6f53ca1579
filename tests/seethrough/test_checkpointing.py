"""The audits behind torch.utils.checkpoint give the answer of a real backward.

A reentrant checkpoint runs its segment under ``no_grad`` and re-runs it in backward: the
parameters it uses are in no graph the audits can walk, and ``torch.autograd.grad`` refuses
it. Each audit is compared with brute force: a real ``backward()``, which runs the segment
again and writes ``.grad``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from isolate._autograd import walk
from isolate._checkpointing import differentiate, keep_arguments
from isolate.cutoff import assert_reached, cut_off_parameters, trace_forward
from isolate.errors import BlindSpotError, CutOffError, GradientLeakError
from isolate.gradients import gradient_invariance, gradient_report
from isolate.reachability import assert_isolated, reachable_parameters

MODES = ["reentrant", "non_reentrant", "none"]


def real_grads(loss: torch.Tensor, model: nn.Module) -> dict[str, torch.Tensor | None]:
    """What one real backward of ``loss`` writes to each trainable parameter's ``.grad``."""
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    grads = {
        n: None if p.grad is None else p.grad.clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return grads


def reached(grads: dict[str, torch.Tensor | None]) -> tuple[str, ...]:
    return tuple(n for n, g in grads.items() if g is not None)


class Net(nn.Module):
    """embed -> [segment: block, and side read through .detach()] -> head; probe on the
    segment's output; ``unused`` never runs."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 6)
        self.block = nn.Linear(6, 6)
        self.side = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)
        self.probe = nn.Linear(6, 2)
        self.unused = nn.Linear(6, 1)
        self.mode = mode

    def segment(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(h)) + self.side(h).detach()

    def run(self, ids: torch.Tensor, *, leak: bool) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(ids)
        if self.mode == "none":
            z = self.segment(h)
        else:
            z = checkpoint(self.segment, h, use_reentrant=self.mode == "reentrant")
        main = self.head(z).pow(2).mean()
        probe = self.probe(z if leak else z.detach()).pow(2).mean()
        return main, probe


IDS = torch.tensor([1, 4, 2, 7, 7])


@pytest.mark.parametrize("leak", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_reachable_and_assert_isolated_match_a_real_backward(mode: str, leak: bool) -> None:
    model = Net(mode)
    main, probe = model.run(IDS, leak=leak)
    truth = reached(real_grads(probe, model))
    assert reachable_parameters(probe, model) == truth
    assert ("block.weight" in truth) == leak  # the probe's gradient enters the segment
    if leak:
        route = "CheckpointFunctionBackward" if mode == "reentrant" else "AddBackward0"
        with pytest.raises(
            GradientLeakError, match=rf"(?s)^assert_isolated\(\): .*block\.weight.*{route}"
        ):
            assert_isolated(probe, model.block, model=model)
    else:
        assert_isolated(probe, model.block, model=model)
    assert reachable_parameters(main, model) == reached(real_grads(main, model))


@pytest.mark.parametrize("mode", MODES)
def test_cut_off_and_assert_reached_match_a_real_backward(mode: str) -> None:
    model = Net(mode)
    main, _ = model.run(IDS, leak=False)
    grads = real_grads(main, model)
    missing = [n for n, g in grads.items() if g is None]
    assert missing == [f"{m}.{p}" for m in ("side", "probe", "unused") for p in ("weight", "bias")]
    assert list(cut_off_parameters(main, model).parameters) == missing
    assert_reached(main, model, expected_unused=["side", "probe", "unused"])
    with pytest.raises(CutOffError, match=r"(?s)side\.weight, side\.bias"):
        assert_reached(main, model, expected_unused=["probe", "unused"])


@pytest.mark.parametrize("leak", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_report_and_invariance_match_a_real_backward(mode: str, leak: bool) -> None:
    model = Net(mode)
    main, probe = model.run(IDS, leak=leak)
    report = gradient_report({"main": main, "probe": probe}, model)
    for loss_name, loss in (("main", main), ("probe", probe)):
        grads = real_grads(loss, model)
        for group in ("embed", "block", "side", "head", "probe"):
            got = report[group].norms[loss_name]
            members = [g for n, g in grads.items() if n.startswith(f"{group}.")]
            if all(g is None for g in members):
                assert got is None, (group, loss_name)
            else:
                want = math.sqrt(
                    sum(float(g.double().pow(2).sum()) for g in members if g is not None)
                )
                assert got == pytest.approx(want, rel=1e-5), (group, loss_name)
    invariance = gradient_invariance(main, main + probe, model.block)
    main_grads, total_grads = real_grads(main, model), real_grads(main + probe, model)
    for name in ("weight", "bias"):
        a, b = main_grads[f"block.{name}"], total_grads[f"block.{name}"]
        assert a is not None and b is not None
        assert invariance.deltas[name] == pytest.approx(float((a - b).abs().max()), abs=1e-6)
    assert invariance.isolated == (not leak)
    assert (invariance.max_delta > 0.1) == leak


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("reentrant", [True, False])
def test_segment_whose_inputs_need_no_grad_cuts_its_parameters_off(reentrant: bool) -> None:
    """A frozen embedding feeds the segment: reentrant, its forward carries no graph and
    the block never learns (brute force agrees); non-reentrant, the block is reached."""
    model = Net("reentrant" if reentrant else "non_reentrant")
    model.embed.weight.requires_grad_(False)
    with trace_forward(model) as trace:
        main, _ = model.run(IDS, leak=False)
    truth = reached(real_grads(main, model))
    assert ("block.weight" in truth) == (not reentrant)
    assert reachable_parameters(main, model) == truth
    cut = cut_off_parameters(main, model, trace=trace, expected_unused=["probe", "unused"])
    assert ("block.weight" in cut.parameters) == reentrant
    if reentrant:
        assert "ran inside a reentrant checkpoint whose inputs do not require grad" in str(cut)
        with pytest.raises(CutOffError, match=r"(?s)block\.weight, block\.bias"):
            assert_reached(main, model, expected_unused=["side", "probe", "unused"])


def test_the_audit_leaves_rng_buffers_and_trace_as_they_were() -> None:
    """The re-run replays the forward's RNG state (the same dropout mask as backward), and
    leaves the program's RNG, the BatchNorm statistics and a recording trace untouched."""
    torch.manual_seed(0)
    segment = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 6))
    model = nn.ModuleDict({"embed": nn.Linear(3, 6), "segment": segment})
    x = torch.randn(8, 3)
    with trace_forward(model) as trace:
        loss = checkpoint(segment, model["embed"](x), use_reentrant=True).pow(2).sum()
        stats = {k: v.clone() for k, v in segment[1].state_dict().items()}
        torch.rand(3)  # the program moves on: the audit must not rewind its RNG
        rng = torch.get_rng_state()
        calls = {k: len(v) for k, v in trace.calls.items()}
        report = gradient_report({"loss": loss}, model, groups=["segment"])
        assert reachable_parameters(loss, model) == tuple(n for n, _ in model.named_parameters())
        assert cut_off_parameters(loss, model, trace=trace).clean
        assert {k: len(v) for k, v in trace.calls.items()} == calls
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in segment[1].state_dict().items():
        assert torch.equal(value, stats[key]), key
    grads = real_grads(loss, model)  # backward itself updates the statistics once more
    want = math.sqrt(sum(float(g.pow(2).sum()) for n, g in grads.items() if "segment" in n))
    assert report["segment"].norms["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("fake", [True, False])
def test_the_walk_keeps_none_of_what_a_re_run_segment_saves(fake: bool) -> None:
    """A walk needs the re-run graph's structure only: holding every segment's activations
    at once would cost what checkpointing saves (re-run on fake tensors, or for real where a
    forward hook must see real values)."""
    model = Net("reentrant")
    if not fake:
        model.block.register_forward_hook(lambda *_: None)
    main, _ = model.run(IDS, leak=False)
    found = walk([main], "test")
    tanh = [node for node in found.parent if node.name() == "TanhBackward0"]
    assert len(tanh) == 1  # the segment's, from the re-run
    with pytest.raises(RuntimeError, match=r"kept none of its saved tensors"):
        tanh[0]._saved_result  # noqa: B018
    assert reachable_parameters(main, model) == reached(real_grads(main, model))


def _nested(reentrant: bool) -> tuple[nn.ModuleDict, Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(1)
    model = nn.ModuleDict(
        {"embed": nn.Linear(4, 4), "outer": nn.Linear(4, 4), "inner": nn.Linear(4, 4)}
    )
    scale = nn.Linear(4, 4)
    model["scale"] = scale

    def inner(h: torch.Tensor) -> torch.Tensor:
        return torch.sin(model["inner"](h))

    def outer(h: torch.Tensor, ignored: torch.Tensor) -> torch.Tensor:
        return checkpoint(inner, model["outer"](h), use_reentrant=reentrant)

    return model, outer


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("reentrant", [True, False])
def test_nested_segments_unused_arguments_and_captured_tensors(reentrant: bool) -> None:
    """A segment inside a segment; an argument the segment ignores (no gradient reaches what
    produced it); a tensor the segment closes over (gradient reaches what produced it)."""
    model, outer = _nested(reentrant)
    x = torch.randn(3, 4)
    captured = model["scale"](x)

    def segment(h: torch.Tensor, ignored: torch.Tensor) -> torch.Tensor:
        return outer(h, ignored) * captured

    ignored = model["embed"](x) * 3
    z = checkpoint(segment, model["embed"](x), ignored, use_reentrant=reentrant)
    loss = z.pow(2).sum()
    # The audits first: the backward of a reentrant checkpoint frees the graph behind a
    # captured tensor even under retain_graph=True (its inner backward does not retain).
    found = reachable_parameters(loss, model)
    report = gradient_report({"loss": loss}, model, groups=["embed", "outer", "inner", "scale"])
    grads = real_grads(loss, model)
    assert found == reached(grads) == tuple(n for n, _ in model.named_parameters())
    for group in ("embed", "outer", "inner", "scale"):
        want = math.sqrt(
            sum(float(g.pow(2).sum()) for n, g in grads.items() if n.startswith(group))
        )
        assert report[group].norms["loss"] == pytest.approx(want, rel=1e-5), group
    captured = model["scale"](x)  # a fresh graph behind the captured tensor
    only_ignored = checkpoint(segment, x, ignored, use_reentrant=reentrant).sum()
    assert "embed.weight" not in reachable_parameters(only_ignored, model)
    assert "embed.weight" not in reached(real_grads(only_ignored, model))


def test_a_segment_that_cannot_be_re_run_is_refused_by_every_audit() -> None:
    model = Net("reentrant")
    main, probe = model.run(IDS, leak=True)
    main.backward()  # frees the segment's saved arguments
    audits = [
        ("reachable_parameters", lambda: reachable_parameters(probe, model)),
        ("assert_isolated", lambda: assert_isolated(probe, model.block)),
        ("cut_off_parameters", lambda: cut_off_parameters(probe, model)),
        ("assert_reached", lambda: assert_reached(probe, model)),
        ("gradient_report", lambda: gradient_report({"probe": probe}, model)),
        ("gradient_invariance", lambda: gradient_invariance(probe, probe * 1, model.block)),
    ]
    for caller, audit in audits:
        with pytest.raises(
            BlindSpotError,
            match=rf"^{caller}\(\): cannot re-run the reentrant checkpoint of Net\.segment to "
            r"see which parameters it uses: its saved arguments are gone.*retain_graph=True",
        ):
            audit()

    calls = []

    def flaky(h: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("only once")
        return model.block(h)

    loss = checkpoint(flaky, model.embed(IDS), use_reentrant=True).sum()
    with pytest.raises(BlindSpotError, match=r"re-running the reentrant checkpoint of .*flaky"):
        reachable_parameters(loss, model)

    scale = nn.Linear(6, 6)
    captured = scale(model.embed(IDS))
    loss = checkpoint(lambda h: model.block(h) * captured, model.embed(IDS), use_reentrant=True)
    loss = loss.sum()
    loss.backward(retain_graph=True)  # the segment's inner backward frees what it captured
    with pytest.raises(BlindSpotError, match=r"freed by an earlier backward.*before backward"):
        gradient_report({"loss": loss}, model)
    plain = model.head(model.embed(IDS)).sum()
    plain.backward()
    with pytest.raises(BlindSpotError, match=r"^gradient_invariance\(\): part of the loss"):
        gradient_invariance(plain, plain * 1, model.head)


def test_one_verification_re_runs_each_segment_once_for_all_its_walks() -> None:
    """The named losses' walk and the total's reach walk share one re-run of each segment
    (one forward's worth of compute, not two), and answer as a real backward does."""
    from isolate.spec import IsolationSpec

    model = Net("reentrant")
    calls: list[int] = []
    segment = model.segment

    def counted(h: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return segment(h)

    model.segment = counted  # type: ignore[method-assign]
    handle = IsolationSpec(freeze=["probe", "unused", "side"]).apply(model)
    try:
        main, _ = model.run(IDS, leak=False)
        assert len(calls) == 1  # the forward
        verification = handle.verify({"main": main}, total=main)
        assert len(calls) == 2  # one re-run for both walks
        assert verification.losses == {"main": 6} and verification.reach == 5
        assert reached(real_grads(main, model)) == (
            "embed.weight", "block.weight", "block.bias", "head.weight", "head.bias",
        )  # fmt: skip
        assert len(calls) == 3  # the backward's own re-run
        # Outside a verification every walk re-runs the segment again: nothing is kept.
        reachable_parameters(main, model)
        reachable_parameters(main, model)
        assert len(calls) == 5
    finally:
        handle.restore()


@pytest.mark.parametrize("side_frozen", [True, False])
def test_the_loop_checks_reach_after_backward_through_reentrant_segments(
    side_frozen: bool,
) -> None:
    """Backward frees what a reentrant segment saved; the loop's reach check after it re-runs
    the segment from the arguments kept before backward, and sees inside: a parameter the
    segment reads only through ``.detach()`` is named cut off, as a real backward finds."""
    from isolate.spec import IsolationSpec

    model = Net("reentrant")
    frozen = ["probe", "unused", *(["side"] if side_frozen else [])]
    handle = IsolationSpec(freeze=frozen).apply(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    handle.attach(opt)
    try:
        loop = handle.check_every(1)
        loop.begin_step(epoch=0, step=0)
        main, _ = model.run(IDS, leak=False)
        loop.before_backward(main, {"main": main})
        main.backward()
        assert model.side.weight.grad is None and model.block.weight.grad is not None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if side_frozen:
            loop.end_step()
            assert handle.tally.times["reach"] == 1
            assert handle.tally.last["reach"].reach == 5  # embed, block (2), head (2)
        else:
            with pytest.raises(CutOffError, match=r"side\.weight"):
                loop.end_step()
    finally:
        handle.restore()


def test_a_refused_segment_is_named_by_its_function_under_the_caller_that_ran_it() -> None:
    """A segment's function is named through a ``functools.partial``, a module by its class;
    a segment that cannot be re-run is refused in the caller's name."""
    model = Net("reentrant")
    # A forward hook makes the walk re-run the segment for real, not on fake tensors.
    model.block.register_forward_hook(lambda *_: None)
    loss = checkpoint(model.block, model.embed(IDS), use_reentrant=True).sum()
    loss.backward()
    with pytest.raises(
        BlindSpotError,
        match=r"^reachable_parameters\(\): cannot re-run the reentrant checkpoint of Linear to "
        r"see which parameters it uses: its saved arguments are gone",
    ):
        reachable_parameters(loss, model)

    calls = []

    def flaky(h: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("only once")
        return model.block(h) * scale

    segment = functools.partial(functools.partial(flaky, scale=2.0))
    loss = checkpoint(segment, model.embed(IDS), use_reentrant=True).sum()
    with pytest.raises(
        BlindSpotError,
        match=r"^mine\(\): re-running the reentrant checkpoint of "
        r"test_a_refused_segment_is_named_by_its_function_under_the_caller_that_ran_it\.<locals>"
        r"\.flaky, as backward would, failed with ValueError: only once",
    ):
        differentiate(loss, [model.block.weight], "mine()")


def test_a_segments_arguments_and_outputs_that_take_no_gradient_are_passed_over() -> None:
    """An integer argument and a tensor that does not require grad go into the segment, and
    come out of it beside outputs the loss does not use: the gradients are backward's."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 1)})
    x = torch.randn(2, 3, requires_grad=True)

    def segment(
        h: torch.Tensor, k: int, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        return model["a"](h) * k, model["b"](h).sum(), k, mask * 2

    a, _, k, doubled = checkpoint(segment, x, 3, torch.ones(2, 3), use_reentrant=True)
    assert k == 3 and doubled.requires_grad  # the node's output, though the re-run's is not
    loss = a.pow(2).sum() + doubled.sum()
    params = [x, *model.parameters()]
    got = differentiate(loss, params, "test")
    # b gets backward's zeros from the output the loss does not use: reached, as .grad says
    assert reachable_parameters(loss, model) == ("a.weight", "a.bias", "b.weight", "b.bias")
    loss.backward()
    assert model["b"].weight.grad is not None
    for g, p in zip(got, params, strict=True):
        assert g is not None and p.grad is not None
        torch.testing.assert_close(g, p.grad)
    assert not model["b"].weight.grad.any()  # the unused output's gradient: zeros, as backward


def test_a_parameter_used_in_two_segments_and_outside_gets_the_sum_of_their_gradients() -> None:
    torch.manual_seed(0)
    block = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    h = block(checkpoint(block, x, use_reentrant=True))
    loss = checkpoint(lambda t: torch.tanh(block(t)), h, use_reentrant=True).pow(2).sum()
    got = differentiate(loss, [block.weight, block.bias, x], "test")
    loss.backward()
    for g, p in zip(got, [block.weight, block.bias, x], strict=True):
        assert g is not None and p.grad is not None
        torch.testing.assert_close(g, p.grad)


def test_a_segment_whose_re_run_needs_no_gradient_gives_none() -> None:
    """The forward marks a reentrant segment's output as requiring grad whenever an argument
    does; its re-run may not (a frozen layer over a detached argument): nothing inside it gets
    a gradient (backward itself refuses such a segment)."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"frozen": nn.Linear(3, 3).requires_grad_(False), "head": nn.Linear(3, 1)}
    )
    x = torch.randn(2, 3, requires_grad=True)
    out = checkpoint(lambda t: model["frozen"](t.detach()), x, use_reentrant=True)
    assert out.requires_grad
    loss = out.sum() + model["head"](x).sum()
    got = differentiate(loss, [x, *model["head"].parameters()], "test")
    assert got[0] is not None and got[1] is not None and got[2] is not None
    torch.testing.assert_close(got[0], model["head"].weight.detach().expand(2, 3))
    torch.testing.assert_close(got[1], x.detach().sum(0, keepdim=True))
    torch.testing.assert_close(got[2], torch.tensor([2.0]))


def test_the_search_for_segments_looks_at_each_node_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of ten diamonds doubles the routes to the segment; the search is linear in nodes."""
    import isolate._checkpointing as checkpointing

    looked: list[object] = []
    is_reentrant = checkpointing.is_reentrant

    def counted(node: object) -> bool:
        looked.append(node)
        return is_reentrant(node)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpointing, "is_reentrant", counted)
    block = nn.Linear(3, 3)
    h = checkpoint(block, torch.randn(2, 3, requires_grad=True), use_reentrant=True)
    for _ in range(10):
        h = h + h.sin()
    kept = keep_arguments([h.sum()])
    assert [type(node).__name__ for node in kept] == ["CheckpointFunctionBackward"]
    assert len(looked) == len(set(looked)) == 1 + 2 * 10 + 2  # sum, the diamonds, segment, leaf
