"""The examples run, and train exactly what the same training does by hand.

"By hand" is the spec of ``examples/isolation.yaml`` written with ``requires_grad_``,
``.eval()`` and ``.detach()``: the spec must add nothing to the numbers, bit for bit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from examples import fabric_loop, lightning_callback, plain_loop
from examples.toy import Net, batches
from isolate.errors import CheckpointMismatchError
from tests._launch import REPO, child_env

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def by_hand(epochs: int) -> Net:
    model = Net()
    model.trunk.requires_grad_(False)
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad],
        lr=0.05,
        momentum=0.9,
        weight_decay=1e-4,
    )
    for epoch in range(epochs):
        model.train()
        model.trunk[1].eval()  # frozen BatchNorm statistics
        if epoch == 2:
            model.trunk[3].requires_grad_(True)
            optimizer.add_param_group({"params": list(model.trunk[3].parameters()), "lr": 0.02})
        for x, y in batches(epoch):
            features = model.trunk(x)
            main = nn.functional.cross_entropy(model.head(features), y)
            probe = nn.functional.cross_entropy(model.probe(features.detach()), y)
            optimizer.zero_grad()
            (main + probe).backward()
            optimizer.step()
    model.requires_grad_(True)
    return model


def assert_bitwise_equal(a: nn.Module, b: nn.Module) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert list(left) == list(right)
    for key in left:
        assert torch.equal(left[key], right[key]), key


@pytest.fixture(scope="module")
def reference() -> Net:
    return by_hand(4)


def test_reference_moves_what_it_should(reference: Net) -> None:
    # Guards the comparisons below: the reference itself trains the head and the thawed
    # layer, and keeps the frozen layer and its BatchNorm statistics where they started.
    start = Net()
    assert not torch.equal(reference.head.weight, start.head.weight)
    assert not torch.equal(reference.trunk[3].weight, start.trunk[3].weight)
    assert torch.equal(reference.trunk[0].weight, start.trunk[0].weight)
    assert torch.equal(reference.trunk[1].running_mean, start.trunk[1].running_mean)


def test_plain_loop_equals_training_by_hand(reference: Net) -> None:
    model = plain_loop.train(4)
    assert_bitwise_equal(model, reference)
    assert type(model.probe) is nn.Linear  # the wrapper is gone after restore
    assert all(p.requires_grad for p in model.parameters())


def test_plain_loop_resumed_equals_uninterrupted(tmp_path: Path, reference: Net) -> None:
    checkpoint = tmp_path / "run.pt"
    plain_loop.train(4, checkpoint=checkpoint, stop_after=1)  # before the thaw
    plain_loop.train(4, checkpoint=checkpoint, stop_after=3)  # across it
    state = torch.load(checkpoint, weights_only=True)
    assert state["isolation"]["thawed"] == [{"name": "trunk.3", "epoch": 2, "global_step": 16}]
    assert_bitwise_equal(plain_loop.train(4, checkpoint=checkpoint), reference)


def test_plain_loop_refuses_a_checkpoint_of_another_spec(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run.pt"
    plain_loop.train(3, checkpoint=checkpoint, stop_after=3)
    state = torch.load(checkpoint, weights_only=True)
    state["isolation"]["spec"]["freeze"] = ["trunk.0.weight"]
    torch.save(state, checkpoint)
    with pytest.raises(CheckpointMismatchError, match=r"  freeze: only in"):
        plain_loop.train(4, checkpoint=checkpoint)


def test_fabric_loop_equals_training_by_hand(tmp_path: Path, reference: Net) -> None:
    assert_bitwise_equal(fabric_loop.train(4), reference)
    checkpoint = tmp_path / "fabric.pt"
    fabric_loop.train(4, checkpoint=checkpoint, stop_after=2)
    assert_bitwise_equal(fabric_loop.train(4, checkpoint=checkpoint), reference)


def test_lightning_example_equals_training_by_hand(tmp_path: Path, reference: Net) -> None:
    module = lightning_callback.train(4, tmp_path)
    assert_bitwise_equal(module.net, reference)
    assert type(module.net.probe) is nn.Linear
    assert (tmp_path / "last.ckpt").is_file()


@pytest.mark.slow
def test_lightning_example_resumed_equals_uninterrupted(tmp_path: Path, reference: Net) -> None:
    stopped = lightning_callback.train(4, tmp_path, stop_after=2)  # the thaw comes at epoch 2
    assert not torch.equal(stopped.net.head.weight, reference.head.weight)
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert (state["epoch"], state["global_step"]) == (2, 16)  # two epochs of 8 steps done
    resumed = lightning_callback.train(4, tmp_path, resume=True)
    assert_bitwise_equal(resumed.net, reference)


def documented_commands() -> list[str]:
    """The example commands the README gives, in its ``<!-- examples -->`` block."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- examples -->\n```bash\n(.*?)```", text, flags=re.S)
    assert block is not None, "README.md has no <!-- examples --> block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_each_example_documents_the_commands_the_readme_gives() -> None:
    commands = documented_commands()
    for script in ("plain_loop.py", "fabric_loop.py", "lightning_callback.py"):
        given = [c for c in commands if c.startswith(f"python examples/{script}")]
        assert given, script
        doc = (REPO / "examples" / script).read_text().split('"""')[1]
        for command in given:
            assert command in doc, command


def test_help_keeps_the_docstrings_command_block() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "plain_loop.py"), "--help"],
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "\n    python examples/plain_loop.py --epochs 4\n" in out
    assert "--checkpoint CHECKPOINT" in out and "resume from this file" in out


@pytest.mark.slow
def test_the_readmes_example_commands_run_as_written(tmp_path: Path, reference: Net) -> None:
    """Each command from a folder holding ``examples/`` (as the repository root does): a run
    that finishes prints what verify checked and the checksum of the training by hand, a run
    stopped on purpose says how to finish."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    checksum = f"head weight checksum: {float(reference.head.weight.detach().double().sum()):.6f}"
    for command in documented_commands():
        words = command.split()
        assert words[0] == "python"
        done = subprocess.run(
            [sys.executable, *words[1:]],
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, (command, done.stderr[-2000:])
        out = done.stdout
        assert re.search(r"^verify ran \d+ times; every check passed:$", out, re.M), command
        assert "  losses (" in out and "'probe' reached none of the 6 parameters" in out
        if "--stop-after" in command:
            assert "Stopped early on purpose" in out, command
        else:
            assert checksum in out, (command, out)
            assert "Why this checksum:" in out


@pytest.mark.parametrize(
    ("example", "argv", "says"),
    [
        (plain_loop, ["--epoks", "4"], "unknown option '--epoks'; did you mean '--epochs'?"),
        (fabric_loop, ["--stop-afer", "2"], "did you mean '--stop-after'?"),
        (lightning_callback, ["--rot", "run"], "did you mean '--root'?"),
        (lightning_callback, ["--root", "{tmp}", "--resume"], "last.ckpt does not exist"),
    ],
)
def test_a_typo_is_one_line_naming_the_fix(
    example: Any, argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        example.main([a.format(tmp=tmp_path) for a in argv])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"python examples/{Path(example.__file__).name}: error: ")
    assert says in line
