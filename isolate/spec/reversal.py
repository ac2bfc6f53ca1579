"""The ``reversal`` contract: domain-adversarial training through a gradient reversal.

The clause that matters is numeric: the domain loss's gradient at the feature extractor's
output must be ``-scale`` times its gradient at the domain classifier's input, which is what
the loss sends back before the reversal. Both come from one ``torch.autograd.grad`` of the
loss with respect to the tensors the two modules returned and received in the checked forward
(the graph is kept for the real backward; only the classifier and the reversal are
differentiated through). So a reversal that is missing (factor +1), has the wrong sign
(+scale) or the wrong scale is named with the factor measured, whatever implements it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import Node

from isolate._autograd import walk
from isolate._checkpointing import is_reentrant
from isolate._compiled import is_compiled
from isolate._walker import Names
from isolate.detaching import gradient_scale_of
from isolate.errors import IsolationError
from isolate.spec.contract_clauses import Clauses, Context, Outcome, module_of, reached_names
from isolate.spec.contracts import Contract

__all__ = ["Reversal"]


class Reversal(Clauses):
    """``{kind: reversal, loss, features, classifier, scale}``: domain-adversarial training."""

    CLAUSES = (
        "reaches the features",
        "reversed at the features",
        "the classifier gets it unreversed",
    )

    def __init__(self, contract: Contract, model: nn.Module, names: Names, caller: str) -> None:
        super().__init__(contract, model, names, caller)
        self.features = module_of(model, str(contract.features), self.where)
        self.classifier = module_of(model, str(contract.classifier), self.where)
        self.feature_params = {names.name(p): p for p in self.features.parameters()}
        self.watch += [(self.features, "outputs"), (self.classifier, "inputs")]
        self.watch.append((self.classifier, "outputs"))

    def graph(self, ctx: Context) -> list[Outcome]:
        contract, loss = self.contract, ctx.loss_of(self.contract)
        if loss is None:
            return []
        reached = reached_names(ctx, self.feature_params, ctx.reached_by(str(contract.loss)))
        clause = "reaches the features"
        if not reached:
            detail = f"loss {contract.loss!r} reaches no parameter of {contract.features!r}"
            return [(clause, ctx.fail(contract, clause, detail))]
        out: list[Outcome] = [(clause, None)]
        features = ctx.recorded.of(self.features, "outputs")
        inputs = ctx.recorded.of(self.classifier, "inputs")
        clause = "reversed at the features"
        if not features or not inputs:
            missing = contract.features if not features else contract.classifier
            detail = f"{missing!r} did not run while the check recorded"
            return [*out, (clause, ctx.blind(contract, clause, detail))]
        out.append((clause, self._reversed(ctx, loss, features, inputs)))
        clause = "the classifier gets it unreversed"
        outputs = {t.grad_fn for t in ctx.recorded.of(self.classifier, "outputs")} - {None}
        plain = walk([loss], ctx.caller, stop=lambda n: gradient_scale_of(n) is not None)
        if outputs and not outputs & set(plain.parent):
            detail = (
                f"every route from loss {contract.loss!r} to the output of "
                f"{contract.classifier!r} passes a gradient scale: the classifier is trained "
                f"to maximise the loss; put the reversal between the features and the "
                f"classifier"
            )
            out.append((clause, ctx.fail(contract, clause, detail)))
            return out
        # A custom autograd Function's backward may be a reversal written by hand: a route
        # through one proves nothing about the sign the classifier gets.
        read = walk(
            [loss], ctx.caller, stop=lambda n: gradient_scale_of(n) is not None or _opaque(n)
        )
        if outputs and not outputs & set(read.parent):
            opaque = sorted({n.name() for n in read.parent if _opaque(n)})
            detail = (
                f"every route from loss {contract.loss!r} to the output of "
                f"{contract.classifier!r} passes {opaque}, a custom autograd Function whose "
                f"backward isolate cannot read: it may reverse the gradient the classifier "
                f"gets; reverse with isolate.GradientScale or isolate.scale_gradient, which the "
                f"check reads"
            )
            out.append((clause, ctx.blind(contract, clause, detail)))
        else:
            out.append((clause, None))
        return out

    def _reversed(
        self,
        ctx: Context,
        loss: torch.Tensor,
        features: list[torch.Tensor],
        inputs: list[torch.Tensor],
    ) -> IsolationError | None:
        contract, clause = self.contract, "reversed at the features"
        wanted = [t for t in [*features, *inputs] if t.requires_grad]
        if not wanted:
            return ctx.blind(
                contract,
                clause,
                f"neither the outputs of {contract.features!r} nor the inputs of "
                f"{contract.classifier!r} carry a gradient (they are integer or were computed "
                f"under no_grad); name the modules on either side of the reversal",
            )
        at_features, at_inputs = _flat_gradients(loss, wanted, features, inputs)
        if at_features.numel() != at_inputs.numel():
            return ctx.blind(
                contract,
                clause,
                f"the outputs of {contract.features!r} ({at_features.numel()} numbers) and the "
                f"inputs of {contract.classifier!r} ({at_inputs.numel()}) cannot be paired "
                f"element for element; name the modules on either side of the reversal",
            )
        scale = float(contract.scale or 0.0)
        expected = -scale * at_inputs
        eps = max(torch.finfo(t.dtype).eps for t in wanted)  # the coarsest gradient compared
        tol = 8 * eps * (at_features.abs() + expected.abs()) + eps * float(expected.abs().max())
        if bool(((at_features - expected).abs() <= tol).all()):
            return None
        norm = float(at_inputs.dot(at_inputs))
        factor = float(at_features.dot(at_inputs)) / norm if norm else float("nan")
        return ctx.fail(
            contract,
            clause,
            f"the gradient of loss {contract.loss!r} at the output of {contract.features!r} is "
            f"{factor:+.4g} times its gradient at the input of {contract.classifier!r}, expected "
            f"{-scale:+.4g} (a reversal of scale {scale:g}); "
            + (
                "the reversal is missing"
                if abs(factor - 1.0) < 1e-3
                else "the sign is wrong"
                if abs(factor - scale) < 1e-3 * max(scale, 1.0)
                else "the scale differs"
            ),
        )


def _opaque(node: Node) -> bool:
    """Whether ``node`` is the backward of a custom ``torch.autograd.Function`` other than a
    gradient scale, a reentrant checkpoint or a compiled region (the walk reads those)."""
    return (
        getattr(type(node), "_forward_cls", None) is not None
        and gradient_scale_of(node) is None
        and not is_reentrant(node)
        and not is_compiled(node)
    )


def _flat_gradients(
    loss: torch.Tensor,
    wanted: list[torch.Tensor],
    features: list[torch.Tensor],
    inputs: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``loss`` at ``features`` and at ``inputs``, each side in one float64
    vector (a complex gradient's real and imaginary parts side by side; zeros where the loss
    sends back nothing), from one ``torch.autograd.grad`` over ``wanted`` (never empty)."""
    grads = dict(
        zip(
            map(id, wanted),
            torch.autograd.grad(loss, wanted, retain_graph=True, allow_unused=True),
            strict=True,
        )
    )

    def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        out = []
        for t in tensors:
            g = grads.get(id(t))
            g = torch.zeros_like(t) if g is None else g
            out.append((torch.view_as_real(g) if g.is_complex() else g).reshape(-1).double())
        return torch.cat(out)

    return flat(features), flat(inputs)
