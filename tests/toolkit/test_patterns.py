"""Real architectures and training patterns: every reachability answer is checked against brute
force (``torch.autograd.grad(..., allow_unused=True)``: reached == grad is not None)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import isolate
from isolate import assert_isolated, gradient_report
from isolate.drift import snapshot
from isolate.errors import DriftError, GradientLeakError
from isolate.exposure import optimizer_exposure
from isolate.gradients import gradient_invariance
from isolate.reachability import reachable_parameters

pytestmark = pytest.mark.usefixtures("one_thread")


def brute_force(losses: torch.Tensor | Sequence[torch.Tensor], model: nn.Module) -> tuple[str, ...]:
    """Names whose gradient autograd computes. Exactly-zero gradients still come back as
    tensors, so ``is not None`` (not ``!= 0``) is the comparison that matches a graph walk."""
    outputs = [losses] if isinstance(losses, torch.Tensor) else list(losses)
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    reached: set[int] = set()
    for out in outputs:
        grads = torch.autograd.grad(
            out.sum(), [p for _, p in named], retain_graph=True, allow_unused=True
        )
        reached |= {id(p) for (_, p), g in zip(named, grads, strict=True) if g is not None}
    return tuple(n for n, p in named if id(p) in reached)


def reach(loss: torch.Tensor | Sequence[torch.Tensor], model: nn.Module) -> tuple[str, ...]:
    """reachable_parameters, asserted equal to brute force."""
    found = reachable_parameters(loss, model)
    assert found == brute_force(loss, model)
    return found


def names(module: nn.Module, prefix: str = "") -> tuple[str, ...]:
    return tuple(prefix + n for n, _ in module.named_parameters(remove_duplicate=False))


# --------------------------------------------------------------------------------------------
# ResNet-18 (torchvision, random weights)


@pytest.fixture(scope="module")
def resnet() -> torchvision.models.ResNet:
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None, num_classes=10)


def resnet_features(m: torchvision.models.ResNet, x: torch.Tensor) -> torch.Tensor:
    x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
    x = m.layer4(m.layer3(m.layer2(m.layer1(x))))
    return torch.flatten(m.avgpool(x), 1)


IMAGES = torch.randn(2, 3, 32, 32)
LABELS = torch.tensor([1, 7])


def test_resnet18_full_forward_reaches_every_parameter(resnet: torchvision.models.ResNet) -> None:
    loss = F.cross_entropy(resnet(IMAGES), LABELS)
    assert reach(loss, resnet) == names(resnet)
    assert len(names(resnet)) == 62


def test_resnet18_linear_probe_on_detached_features(resnet: torchvision.models.ResNet) -> None:
    probe = nn.Linear(512, 10)
    model = nn.ModuleDict({"backbone": resnet, "probe": probe})
    features = resnet_features(resnet, IMAGES)
    main = F.cross_entropy(resnet.fc(features), LABELS)
    probe_loss = F.cross_entropy(probe(isolate.stop_gradient(features)), LABELS)
    assert reach(probe_loss, model) == ("probe.weight", "probe.bias")
    assert_isolated(probe_loss, resnet)
    result = gradient_invariance(main, main + probe_loss, resnet, model=model)
    assert result.max_delta == 0.0 and len(result.deltas) == 62
    leaky = F.cross_entropy(probe(features), LABELS)
    with pytest.raises(GradientLeakError, match=r"^assert_isolated\(\): the loss reaches 60 of"):
        assert_isolated(leaky, "backbone", model=model)
    assert gradient_invariance(main, main + leaky, "backbone.layer4", model=model).max_delta > 0


def test_resnet18_partial_detach(resnet: torchvision.models.ResNet) -> None:
    m = resnet
    x = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(IMAGES))))))
    out = m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(x.detach()))), 1))
    expected = names(m.layer3, "layer3.") + names(m.layer4, "layer4.") + names(m.fc, "fc.")
    assert reach(out.sum(), m) == expected


# --------------------------------------------------------------------------------------------
# TransformerEncoder


def small_transformer() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True
    )
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


TOKENS = torch.randn(2, 5, 16)


def test_transformer_encoder_reaches_every_layer() -> None:
    enc = small_transformer()
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    out = enc(TOKENS, src_key_padding_mask=mask)
    assert reach(out.pow(2).mean(), enc) == names(enc)


def test_transformer_encoder_detached_between_layers() -> None:
    enc = small_transformer()
    h = enc.layers[0](TOKENS).detach()
    out = enc.layers[1](h)
    assert reach(out.sum(), enc) == names(enc.layers[1], "layers.1.")
    assert_isolated(out.sum(), enc.layers[0])


def test_transformer_language_model_with_tied_decoder() -> None:
    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, 16)
            self.encoder = small_transformer()
            self.decoder = nn.Linear(16, 20, bias=False)
            self.decoder.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor, *, freeze_body: bool = False) -> torch.Tensor:
            h = self.encoder(self.embed(tokens))
            return self.decoder(h.detach() if freeze_body else h)

    lm = TinyLM()
    tokens = torch.randint(0, 20, (2, 5))
    logits = lm(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    assert reach(loss, lm) == names(lm)
    assert {"embed.weight", "decoder.weight"} <= set(reach(loss, lm))
    head_only = lm(tokens, freeze_body=True).sum()
    assert reach(head_only, lm) == ("embed.weight", "decoder.weight")
    with pytest.raises(GradientLeakError) as info:
        assert_isolated(head_only, lm.embed, model=lm)
    message = str(info.value)
    assert "\n  embed.weight" in message and "\n  decoder.weight" in message
    assert "MmBackward0" in message or "UnsafeViewBackward0" in message


# --------------------------------------------------------------------------------------------
# MNIST-sized CNN: conv + BatchNorm + linear


class MnistCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * 14 * 14, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


DIGITS = torch.randn(16, 1, 28, 28)
DIGIT_LABELS = torch.arange(16) % 10


def test_mnist_cnn_reachability_and_report() -> None:
    torch.manual_seed(0)
    model = MnistCNN()
    loss = F.cross_entropy(model(DIGITS), DIGIT_LABELS)
    assert reach(loss, model) == names(model)
    with isolate.frozen(model, "features"):
        frozen_loss = F.cross_entropy(model(DIGITS), DIGIT_LABELS)
        assert reach(frozen_loss, model) == ("classifier.1.weight", "classifier.1.bias")
    report = gradient_report({"ce": loss, "l2": model.classifier[1].weight.pow(2).sum()}, model)
    assert list(report.groups) == ["features", "classifier"]
    assert report["features"].norms["l2"] is None and report["classifier"].norms["l2"]


def test_mnist_cnn_frozen_features_stay_put_only_with_bn_eval_and_grad_none() -> None:
    torch.manual_seed(0)
    model = MnistCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)

    def step(*, set_to_none: bool = True) -> None:
        opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(model(DIGITS), DIGIT_LABELS).backward()
        opt.step()

    step()  # momentum state for every parameter
    with isolate.frozen(model, "features", bn="eval"):
        snap = snapshot(model.features)
        for _ in range(2):
            step()
        snap.assert_unchanged()  # grads were dropped on freeze, BatchNorm held in eval

    step()  # unfrozen again: features train, and have fresh grads
    with isolate.frozen(model, "features", bn="train"):
        snap = snapshot(model.features)
        model.features[0].weight.grad = torch.zeros_like(model.features[0].weight)
        exposed = {e.name: e for e in optimizer_exposure(opt, model) if e.moves_on_step}
        assert list(exposed) == ["features.0.weight"]
        step(set_to_none=False)
        with pytest.raises(DriftError) as info:
            snap.assert_unchanged()
    moved = set(snap.changed())
    assert moved == {"0.weight", "1.running_mean", "1.running_var", "1.num_batches_tracked"}
    message = str(info.value)
    assert re.search(r"\n  0\.weight +\(parameter, requires_grad=False\) max\|Δ\|=", message)
    assert "1.running_mean" in message and "bn='eval'" in message


# --------------------------------------------------------------------------------------------
# GAN: the discriminator step


def gan() -> nn.ModuleDict:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return nn.ModuleDict({"G": generator, "D": discriminator})


def test_gan_discriminator_step_reaches_only_the_discriminator() -> None:
    model = gan()
    G, D = model["G"], model["D"]
    z, real = torch.randn(6, 4), torch.randn(6, 8)
    fake = G(z)
    ones, zeros = torch.ones(6, 1), torch.zeros(6, 1)
    d_loss = F.binary_cross_entropy_with_logits(D(real), ones) + F.binary_cross_entropy_with_logits(
        D(fake.detach()), zeros
    )
    assert reach(d_loss, model) == names(D, "D.")
    assert_isolated(d_loss, G)
    # The generator step reaches D too: step only G's optimizer, or freeze D for it.
    g_loss = F.binary_cross_entropy_with_logits(D(fake), ones)
    assert reach(g_loss, model) == names(model)
    with isolate.frozen(model, "D"):
        g_loss = F.binary_cross_entropy_with_logits(D(G(z)), ones)
        assert reach(g_loss, model) == names(G, "G.")
    forgot_detach = F.binary_cross_entropy_with_logits(D(fake), zeros)
    with pytest.raises(GradientLeakError, match=r"G\.2\.weight +in 'G\.2' \(Linear\)"):
        assert_isolated(forgot_detach, "G", model=model)


# --------------------------------------------------------------------------------------------
# SimSiam: symmetric loss with stop-gradient on the targets


def test_simsiam_stop_gradient() -> None:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16))
    predictor = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 16))
    model = nn.ModuleDict({"encoder": encoder, "predictor": predictor})
    x1 = torch.randn(6, 8, requires_grad=True)
    x2 = torch.randn(6, 8, requires_grad=True)
    z1, z2 = encoder(x1), encoder(x2)
    p1, p2 = predictor(z1), predictor(z2)

    def distance(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return -F.cosine_similarity(p, isolate.stop_gradient(z), dim=-1).mean()

    term = distance(p1, z2)
    loss = term / 2 + distance(p2, z1) / 2
    assert reach(loss, model) == names(model)
    # The first term sees view 2 only as a target: no gradient reaches it.
    assert_isolated(term, [("x2", x2)])
    with pytest.raises(GradientLeakError, match=r"\n  x2 "):
        assert_isolated(-F.cosine_similarity(p1, z2, dim=-1).mean(), [("x2", x2)])
    # Without stop-gradient the extra path changes the encoder's gradient.
    no_stop = -F.cosine_similarity(p1, z2, dim=-1).mean()
    assert gradient_invariance(term, term + 0 * no_stop, encoder).max_delta == 0.0
    assert gradient_invariance(term, no_stop, encoder).max_delta > 0


# --------------------------------------------------------------------------------------------
# Gradient reversal (domain-adversarial training)


def test_gradient_reversal_domain_classifier() -> None:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    label_head, domain_head = nn.Linear(8, 3), nn.Linear(8, 2)
    model = nn.ModuleDict({"features": features, "label": label_head, "domain": domain_head})
    x, y, d = torch.randn(10, 6), torch.arange(10) % 3, torch.arange(10) % 2
    f = features(x)
    task = F.cross_entropy(label_head(f), y)
    adversarial = F.cross_entropy(domain_head(isolate.scale_gradient(f, -1.0)), d)
    assert reach(adversarial, model) == names(features, "features.") + names(domain_head, "domain.")
    assert reach([task, adversarial], model) == names(model)
    # Reversal is exact: the features get minus the plain domain gradient, the head the same.
    plain = F.cross_entropy(domain_head(f), d)
    params = list(features.parameters()) + list(domain_head.parameters())
    reversed_grads = torch.autograd.grad(adversarial, params, retain_graph=True)
    plain_grads = torch.autograd.grad(plain, params, retain_graph=True)
    for i, (r, p) in enumerate(zip(reversed_grads, plain_grads, strict=True)):
        assert torch.equal(r, -p if i < 2 else p)
    report = gradient_report({"task": task, "adversarial": adversarial}, model)
    assert report["label"].norms["adversarial"] is None
    assert report["domain"].norms["task"] is None
    # The cosine, by hand: both gradients on the shared features, flattened, in float64.
    feats = list(features.parameters())

    def flat(loss: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(loss, feats, retain_graph=True)
        return torch.cat([g.double().flatten() for g in grads])

    g_task, g_adv = flat(task), flat(adversarial)
    by_hand = float(g_task @ g_adv / (g_task.norm() * g_adv.norm()))
    assert report["features"].cosines[("task", "adversarial")] == pytest.approx(by_hand, rel=1e-5)
    assert report["features"].norms["adversarial"] == pytest.approx(float(g_adv.norm()), rel=1e-6)
    # The label head and the domain head share no parameter: undefined over them, defined
    # (the features) over the whole model.
    assert report["label"].cosines[("task", "adversarial")] is None
    assert report.total.cosines[("task", "adversarial")] is not None


# --------------------------------------------------------------------------------------------
# Linear probe through isolate.Detached


def test_linear_probe_through_detached_wrapper() -> None:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8))
    probe = isolate.Detached(nn.Linear(8, 2))
    model = nn.ModuleDict({"trunk": trunk, "probe": probe})
    x = torch.randn(4, 6)
    features = trunk(x)
    probe_loss = probe(features).pow(2).mean()
    assert reach(probe_loss, model) == ("probe.module.weight", "probe.module.bias")
    assert_isolated(probe_loss, trunk)
    main = features.pow(2).mean()
    assert gradient_invariance(main, main + probe_loss, trunk).isolated
