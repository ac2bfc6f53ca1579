"""The experiment model without data: its branches draw from streams of their own, a branch
spec names a bad field, a detach one layer early cuts the layers before it off, and a
checkpoint resumes the branch streams; the experiment modules' doctests pass."""

from __future__ import annotations

import doctest
from pathlib import Path
from typing import Any

import pytest
import torch

import experiments.cli
import experiments.formats
import experiments.model
import experiments.simsiam
from experiments.model import Branch, IsolationNet
from tests._launch import REPO
from tests.experiments._shared import (
    BEFORE_THE_LAST_LAYER,
    SHARED_DATA,
    needs_data,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::experiments.data.TestSplitOnlyWarning"),
    # Lightning 2.6's CLI calls jsonargparse APIs that jsonargparse 4.49 deprecates.
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]


def test_doctests_of_the_experiment_modules() -> None:
    for module in (experiments.cli, experiments.formats, experiments.model, experiments.simsiam):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_branches_do_not_touch_the_main_random_stream() -> None:
    torch.manual_seed(0)
    plain = IsolationNet()
    torch.manual_seed(0)
    branched = IsolationNet(
        branches=[Branch(name="probe", dropout=0.5), Branch(name="other", connect="attached")]
    )
    for key, value in plain.state_dict().items():
        assert torch.equal(value, branched.state_dict()[key]), key
    images = torch.randn(16, 1, 28, 28)
    torch.manual_seed(1)
    expected = plain._outputs(images)["main"]
    state = torch.get_rng_state()
    torch.manual_seed(1)
    got = branched._outputs(images)  # the probe's dropout draws from its own stream
    assert torch.equal(expected, got["main"])
    assert torch.equal(torch.get_rng_state(), state)


def test_branch_spec_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^Branch\(name='probe'\): connect='plain' is unknown"):
        IsolationNet(branches=[Branch(connect="plain")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"branch names must be unique; repeated: \['probe'\]"):
        IsolationNet(branches=[Branch(), Branch()])
    with pytest.raises(ValueError, match=r"^Branch\(name='probe'\): detach_early=1 needs conn"):
        IsolationNet(branches=[Branch(connect="attached", detach_early=1)])
    with pytest.raises(ValueError, match=r"^Branch\(name='probe'\): detach_early=-1 needs"):
        IsolationNet(branches=[Branch(detach_early=-1)])
    with pytest.raises(ValueError, match=r"detach_early=11 must be at most the trunk's 10 layers"):
        IsolationNet(branches=[Branch(detach_early=11)])
    with pytest.raises(ValueError, match=r"one branch at most may set detach_early.*\['a', 'b'\]"):
        IsolationNet(branches=[Branch(name="a", detach_early=1), Branch(name="b", detach_early=2)])


def test_a_detach_one_layer_early_cuts_the_layers_before_it_off() -> None:
    import isolate

    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    cut = {}
    for early in (0, 1):
        torch.manual_seed(0)
        net = IsolationNet(branches=[Branch(name="probe", detach_early=early)])
        with isolate.cutoff.trace_forward(net) as trace:
            images_out = net._outputs(images)
            total = torch.nn.functional.cross_entropy(images_out["main"], labels)
            total = total + torch.nn.functional.cross_entropy(images_out["probe"], labels)
        cut[early] = isolate.cutoff.cut_off_parameters(total, net, trace=trace).parameters
        if early:
            assert isinstance(net.trunk[9], isolate.Detached)  # moved from the branch
            assert not isinstance(net.branches["probe"], isolate.Detached)
            # The probe's loss now trains the trunk's last layer, and nothing before it.
            reached = isolate.reachability.reachable_parameters(
                torch.nn.functional.cross_entropy(net._outputs(images)["probe"], labels), net
            )
            assert sorted(n for n in reached if n.startswith("trunk")) == [
                "trunk.9.module.bias",
                "trunk.9.module.weight",
            ]
    assert dict(cut[0]) == {}
    assert list(cut[1]) == BEFORE_THE_LAST_LAYER
    assert cut[1]["trunk.4.weight"].startswith("'trunk.4' (Conv2d) ran, but its output does not")
    assert cut[1]["trunk.4.weight"].endswith(
        "starts again at 'trunk.9.module' (Linear), whose input carries no graph"
    )
    # The same weights, the same names in state_dict: only the placement differs.
    torch.manual_seed(0)
    right = IsolationNet(branches=[Branch(name="probe")]).state_dict()
    torch.manual_seed(0)
    early = IsolationNet(branches=[Branch(name="probe", detach_early=1)]).state_dict()
    assert list(right) == list(early)
    assert all(torch.equal(right[k], early[k]) for k in right)


@needs_data
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_checkpoint_resumes_with_the_branch_streams(tmp_path: Path) -> None:
    from experiments.cli import cli_main

    def cli(epochs: int) -> Any:
        return cli_main(
            [
                f"--config={REPO / 'configs' / 'detached.yaml'}",
                f"--trainer.max_epochs={epochs}",
                "--trainer.enable_checkpointing=true",
                "--trainer.limit_val_batches=1",
                "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={tmp_path}",
                f"--data.data_root={SHARED_DATA}",
                f"--data.cache_dir={tmp_path / 'cache'}",
                "--data.download=false",
                "--data.limit_train=256",  # 2 steps per epoch
                "--data.limit_test=64",
                "--record.verbose=false",
            ],
            run=False,
        )

    first = cli(1)
    first.trainer.fit(first.model, datamodule=first.datamodule)
    (checkpoint,) = tmp_path.glob("*/version_0/checkpoints/*.ckpt")  # the logger's folder
    # Plain types only: the checkpoint loads without unpickling arbitrary objects.
    assert torch.load(checkpoint, weights_only=True)["hyper_parameters"]["branches"][0] == {
        **vars(first.model.specs["probe"])
    }
    loaded = IsolationNet.load_from_checkpoint(checkpoint, weights_only=True)
    assert loaded.specs == first.model.specs
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    for name, state in first.model._branch_rng.items():
        assert torch.equal(loaded._branch_rng[name], state), name

    second = cli(2)
    second.trainer.fit(
        second.model, datamodule=second.datamodule, ckpt_path=checkpoint, weights_only=True
    )
    assert second.trainer.global_step == 4
