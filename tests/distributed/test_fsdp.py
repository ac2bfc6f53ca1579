"""Isolation under ``fully_shard`` (FSDP2): audits that see through the shards and the spec
engine on sharded models; FSDP1, HSDP and tensor parallelism by hand. IsolationCallback under
Lightning's ModelParallelStrategy is tested in ``test_lightning_fsdp.py``.

The distributed runs happen in ``_fsdp_script.py`` (2 CPU processes with gloo, 4 for the
HSDP mesh); each rank writes what it measured, and the tests assert on it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests._launch import launch, ranks

SCRIPT = Path(__file__).with_name("_fsdp_script.py")


def _run(mode: str, out: Path, world: int = 2) -> list[dict[str, Any]]:
    launch([sys.executable, str(SCRIPT), mode, str(out)], cwd=out)
    records = ranks(out, mode, world)
    for rank in records:
        assert "error" not in rank, rank["error"]
    return records


@pytest.fixture(scope="module")
def audits(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("audits", tmp_path_factory.mktemp("fsdp_audits"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("engine", tmp_path_factory.mktemp("fsdp_engine"))


@pytest.mark.slow
def test_a_walk_through_a_sharded_checkpointed_layer_agrees_with_backward(tmp_path: Path) -> None:
    everything = ["inp.weight", "inp.bias", "block.weight", "block.bias"]
    everything += ["head.weight", "head.bias"]
    for rank in _run("checkpointed", tmp_path):
        # FSDP2's unsharding hooks are not isolate's: the segment is re-run for real, not on
        # fake tensors.
        assert rank["fake"] == [False]
        assert rank["reached"] == rank["real"] == everything
        # The re-run left the shards as they were: the real backward equals the unsharded
        # model's.
        assert rank["grads equal unsharded"] is True


TRUNK = ["trunk.0.weight", "trunk.0.bias", "trunk.2.weight", "trunk.2.bias"]


@pytest.mark.slow
def test_reachable_parameters_sees_through_the_shards(audits: list[dict[str, Any]]) -> None:
    for rank in audits:
        assert (
            rank["joined/reach"] == rank["joined/reach_ref"] == [*TRUNK, "aux.weight", "aux.bias"]
        )
        assert rank["cut/reach"] == rank["cut/reach_ref"] == ["aux.weight", "aux.bias"]
        # Negative control: the walk alone finds none of the sharded parameters, so an audit
        # that did not map the shards would answer () and "isolated" for a loss that reaches
        # the trunk.
        assert rank["joined/raw_reach"] == [] and rank["joined/raw_trunk_hits"] == []


@pytest.mark.slow
def test_assert_isolated_fails_where_the_loss_reaches_a_sharded_layer(
    audits: list[dict[str, Any]],
) -> None:
    for rank in audits:
        for key in ("joined/isolated", "joined/isolated_ref"):
            assert rank[key].startswith(
                "GradientLeakError: assert_isolated(): the loss reaches 2 of 2 protected"
            )
            assert "trunk.2.weight" in rank[key] and "AddmmBackward0" in rank[key]
        assert rank["joined/isolated_no_model"].startswith(
            "GradientLeakError: assert_isolated(): the loss reaches 4 of 4"
        )
        assert rank["cut/isolated"] == rank["cut/isolated_no_model"] == ""


@pytest.mark.slow
def test_gradient_audits_equal_the_unsharded_model(audits: list[dict[str, Any]]) -> None:
    for rank in audits:
        for key in ("joined", "cut"):
            report, ref = rank[f"{key}/report"], rank[f"{key}/report_ref"]
            for group in ("trunk", "head", "aux"):
                got, want = report["groups"][group]["norm"], ref["groups"][group]["norm"]
                assert got.keys() == want.keys()
                for loss, value in want.items():
                    assert (got[loss] is None) == (value is None), (key, group, loss)
                    if value is not None:
                        assert got[loss] == pytest.approx(value, rel=1e-6)
            assert rank[f"{key}/invariance"] == pytest.approx(rank[f"{key}/invariance_ref"])
        assert set(rank["cut/invariance"].values()) == {0.0}
        assert all(d > 0 for d in rank["joined/invariance"].values())
        assert rank["cut/report"]["groups"]["trunk"]["norm"]["aux"] is None


@pytest.mark.slow
def test_unmapped_sharded_leaves_are_refused(audits: list[dict[str, Any]]) -> None:
    # With the FSDP2 mapping switched off, the generic rule still refuses.
    for rank in audits:
        for key in ("joined/unmapped", "cut/unmapped"):
            assert rank[key].startswith(
                "ShardedGraphError: reachable_parameters(): the graph's leaves are not the "
                "model's parameters"
            )
        assert rank["joined/unmapped_report"].startswith("ShardedGraphError: gradient_report()")
        assert "'trunk.2.weight'" in rank["joined/unmapped"]


@pytest.mark.slow
def test_snapshot_follows_the_shards(audits: list[dict[str, Any]]) -> None:
    for rank in audits:
        # Between forward and backward the root unit registers unsharded temporaries; the
        # snapshot still reads the shards, so nothing "changed" or was "replaced".
        assert rank["snapshot/after_forward"] == rank["snapshot/replaced_after_forward"] == []
        assert rank["snapshot/after_head_step"] == ["head.bias", "head.weight"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_spec_on_a_sharded_model(engine: list[dict[str, Any]], optimizer: str) -> None:
    runs = [rank[optimizer] for rank in engine]
    for run in runs:
        # thaw at step 2 adds the two DTensor parameters of trunk.3 once, as a new group
        assert run["thawed"] == [[], [], ["trunk.3"], []]
        assert run["groups"] == [[4], [4], [4, 2], [4, 2]]
        assert run["thawed_group_is_dtensors"] == [True, True]
        assert run["ids_in_optimizer"] == run["unique_ids_in_optimizer"] == 6
        # every check passed on every step, the rank check across both processes
        assert [v[1] for v in run["verify"]] == [2, 2, 2, 2]
        assert all(v[2] == [] for v in run["verify"])
        assert [v[0]["aux"] for v in run["verify"]] == [6, 6, 4, 4]
        assert all(run["requires_grad_after_restore"])
        assert run["aux_type_after_restore"] == "FSDPLinear"  # the Detached wrapper is gone
        prints = run["prints"]  # full tensors, before and after each of 4 steps
        for name in ["trunk.0.weight", "trunk.0.bias", "trunk.1.weight", "trunk.1.bias"]:
            assert len({p[name] for p in prints}) == 1, name  # frozen: bitwise unchanged
        for name in ["trunk.1.running_mean", "trunk.1.running_var"]:
            assert len({p[name] for p in prints}) == 1, name  # bn="eval" holds the stats
        w = [p["trunk.3.weight"] for p in prints]
        assert w[0] == w[1] == w[2] and w[3] != w[2] and w[4] != w[3]  # moves once thawed
        assert len({p["head.weight"] for p in prints}) == 5
    # the ranks hold identical full parameters after every step, the thaw included
    assert runs[0]["prints"] == runs[1]["prints"]


@pytest.mark.slow
def test_thaw_is_lost_on_an_unsharded_unit_without_isolate(engine: list[dict[str, Any]]) -> None:
    for rank in engine:
        assert rank["naive_thaw_moves"] == [False, False]  # negative control
        # reshard first, then flip the DTensors: the head trains from the first step on
        assert rank["isolate_thaw_moves"] == [True, True]


@pytest.mark.slow
def test_rank_check_compares_fingerprints(engine: list[dict[str, Any]]) -> None:
    for rank in engine:
        assert len(rank["ranks_plain"]) == 1
        assert rank["ranks_plain"][0].startswith(
            "test: parameters differ across the 2 ranks (now): ['t']\n"
            "  t: ranks [0] vs [1] hold different values"
        )
        assert rank["ranks_sharded"] == []  # FSDP shards have one owner each
        assert rank["units_settled"] == 4


@pytest.mark.slow
def test_a_violation_on_one_rank_is_raised_on_every_rank(engine: list[dict[str, Any]]) -> None:
    first, second = (rank["one_verdict"] for rank in engine)
    # drift alone is local: only the owner of the moved shard sees it
    assert first["alone"] == []
    assert second["alone"][0] == "DriftError" and "['trunk.0.weight']" in second["alone"][1]
    # with the ranks check, one verdict: the same error type on both, rank 0 told by rank 1
    assert second["with_ranks"][0] == first["with_ranks"][0] == "DriftError"
    assert first["with_ranks"][1].startswith(
        "IsolationSpec: on rank 1 of 2: frozen tensors moved (at epoch 0, step 0): "
        "['trunk.0.weight']"
    )
    assert second["with_ranks"][1].startswith("IsolationSpec: frozen tensors moved")
    # warned about, the violation is in both ranks' verification (a shard's owner alone
    # holds it, so the fingerprint comparison itself finds nothing to compare)
    assert len(first["warned"]) == len(second["warned"]) == 1
    assert "on rank 1 of 2" in first["warned"][0] and "trunk.0.weight" in second["warned"][0]


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("fsdp1", tmp_path_factory.mktemp("fsdp1"))


@pytest.mark.slow
def test_fsdp1_by_hand_on_the_cpu(fsdp1: list[dict[str, Any]]) -> None:
    for rank in fsdp1:
        # one unit holds the frozen layer and the trainable one: warned, memory not saved
        assert len(rank["warnings"]) == 1
        assert rank["warnings"][0].startswith("IsolationSpec: FSDP1 units mix frozen and")
        assert "memory is not saved" in rank["warnings"][0]
        # frozen for step 0, thawed at step 1, under SGD momentum: every parameter equals
        # the unsharded reference trained the same way on both ranks' batches
        assert rank["matches_reference"] == dict.fromkeys(
            ["0.weight", "0.bias", "2.weight", "2.bias"], True
        )
        assert rank["audit"].startswith(
            "ShardedGraphError: reachable_parameters(): the graph's leaves include 1 FSDP1 "
            "FlatParameter(s)"
        )
        assert rank["orig_params_false"].startswith(
            "UnsupportedStrategyError: IsolationSpec: the model holds FullyShardedDataParallel "
            "units built with use_orig_params=False"
        )
        assert "use_orig_params=True" in rank["orig_params_false"]


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("hsdp", tmp_path_factory.mktemp("hsdp"), world=4)


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh(hsdp: list[dict[str, Any]]) -> None:
    # 4 CPU processes, fully_shard over a (replicate=2, shard=2) mesh: trunk.0 frozen for
    # step 0 and thawed at step 1 under AdamW weight decay, every check passing each step
    for rank in hsdp:
        assert rank["violations"] == [[], [], []]
        w = [p["trunk.0.weight"] for p in rank["prints"]]
        assert w[1] != w[0] and w[2] != w[1]
        assert rank["prints"] == hsdp[0]["prints"]  # identical full tensors on all 4
        # one bit flipped in rank 3's shard of head.weight: its replica is rank 1 (same
        # shard coordinate), and every rank reports that pair and no other
        assert len(rank["corrupted"]) == 1
        assert rank["corrupted"][0].startswith(
            "t: parameters differ across the 4 ranks (now): ['head.weight']\n"
            "  head.weight: ranks [1] vs [3] hold different values"
        )


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("tp", tmp_path_factory.mktemp("tp"))


@pytest.mark.slow
def test_tensor_parallel(tp: list[dict[str, Any]]) -> None:
    # ColwiseParallel / RowwiseParallel: the DTensor parameters are the graph's own leaves
    everything = ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
    for rank in tp:
        assert rank["reach"] == everything
        assert rank["cut_reach"] == ["3.weight", "3.bias"]
        assert rank["isolated"] == ""
        assert rank["violations"] == [[], [], []]
        assert rank["groups"] == [4, 2]
        w = [p["0.weight"] for p in rank["prints"]]
        assert w[1] != w[0] and w[2] != w[1]  # frozen in step 0, thawed at step 1
        assert rank["prints"] == tp[0]["prints"]
