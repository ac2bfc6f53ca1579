"""The claims a variant can declare, and the checks that test them against the runs.

Each claim in a config's ``variant: claims:`` list names a kind (``check:``) and its
parameters; :func:`evaluate_checks` calls the kind's function with the run's record, and each
function returns checks: a claim, the expected and the observed value, and whether they agree.

=================  ==========================================================================
kind               claim (parameters)
=================  ==========================================================================
``reaches``        the ``loss`` reaches ``all`` or ``none`` of the trunk's parameters, by the
                   graph audit of the first step (``loss``, ``expect``, ``part="trunk"``)
``gradient_equal`` the trunk's gradient equals the compared run's at every step, and the final
                   trunk (weights, BatchNorm statistics) is bitwise equal
``gradient_differs`` the trunk's gradient differs from the compared run's at every step
``learns``         the ``output``'s test accuracy is above chance (majority class)
``stops_with``     the run stops with ``error`` whose message holds ``mentions``, after
                   ``step`` steps
``still``          the trunk's ``what`` (``parameters``, ``statistics``, ``counters``) never
                   move from their value at the start
``moves``          the trunk's ``what`` move anyway (``why``: the reason it matters)
``thaws``          the trunk's ``layer`` is thawed at ``step``: its parameters stay exactly
                   where they started at every step before and have moved at every step from
                   then on, while every other layer's parameters never move
``ranks_equal``    at the end of every step from the first thaw on, every process holds the
                   same full parameters, bit for bit (fingerprints gathered from every
                   process; in one process trivially so, and said so)
``spread``         the final per-channel std of SimSiam's ``z/|z|`` stays above ``factor``
                   times ``1/sqrt(dim)``
``collapses``      the final std is below ``factor`` times the ``versus`` run's
``cut_off``        the trainable parameters that the loss backpropagated cannot reach at the
                   first step (``isolate.cutoff.cut_off_parameters``) are exactly ``expect`` (a list
                   of names), and they still hold their first-step values at the end; or
                   ``expect: none``: every trainable parameter is reached
``contract``       the contract ``name`` the run's IsolationCallback declares holds (``holds:
                   true``: every clause checked, none broken) or breaks its ``clause``
                   (``holds: false``, a negative control)
=================  ==========================================================================

A run that should finish and did not gets one failed check, "the run finishes", instead of
its claims.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from experiments.formats import fmt, largest, smallest

__all__ = ["CLAIMS", "evaluate_checks"]

Record = dict[str, Any]
Check = dict[str, Any]


def check(variant: str, claim: str, expected: str, observed: str, ok: bool) -> Check:
    """One row of the report's checks."""
    return {
        "variant": variant,
        "check": claim,
        "expected": expected,
        "observed": observed,
        "ok": bool(ok),
    }


# The names of the trunk's drift series (recording.py) by what the report calls them.
_DRIFT = {"parameters": "parameters", "statistics": "buffers", "counters": "counters"}
_DRIFT_TEXT = {
    "parameters": "trunk parameters",
    "statistics": "BatchNorm running statistics",
    "counters": "num_batches_tracked",
}


class _Context:
    """What a claim reads besides its own run: the other runs and the trunk comparisons."""

    def __init__(self, results: Mapping[str, Any]) -> None:
        self.runs: dict[str, Record] = results["runs"]
        self.variants: dict[str, dict[str, Any]] = results["variants"]
        self.trunks: dict[str, Any] = results.get("trunk_vs_reference", {})

    def compared_steps(self, name: str) -> int | None:
        other = self.variants.get(name, {}).get("compare_with")
        return self.runs.get(other, {}).get("steps") if other else None


def _reaches(
    name: str, record: Record, ctx: _Context, *, loss: str, expect: str, part: str = "trunk"
) -> list[Check]:
    reach = record.get("audit", {}).get(loss, {}).get(part)
    observed = f"{reach[0]}/{reach[1]}" if reach else "not audited"
    if expect == "all":
        claim = f"the {loss} loss reaches every {part} parameter (graph audit)"
        ok = bool(reach) and reach[0] == reach[1] > 0
    elif expect == "none":
        claim = f"the {loss} loss reaches no {part} parameter (graph audit)"
        ok = bool(reach) and reach[0] == 0
    else:
        raise ValueError(f"reaches: expect={expect!r} must be 'all' or 'none'")
    expected = f"all {part} parameters" if expect == "all" else f"no {part} parameter"
    return [check(name, claim, expected, observed, ok)]


def _gradient_equal(name: str, record: Record, ctx: _Context) -> list[Check]:
    deltas = list(record.get("grad_delta") or [])
    steps = ctx.compared_steps(name)
    zero = [d for d in deltas if d == 0.0]
    trunk = ctx.trunks.get(name, {})
    return [
        check(
            name,
            "trunk gradient equals the compared run's at every step",
            f"max|Δ| == 0.0 at all {steps} steps",
            f"{len(zero)}/{len(deltas)} steps exactly 0.0, max|Δ| = {largest(deltas)}",
            bool(deltas) and len(zero) == len(deltas) == steps,
        ),
        check(
            name,
            "final trunk weights and BatchNorm statistics equal the compared run's",
            "bitwise equal",
            f"bitwise equal: {trunk.get('bitwise_equal')}, max|Δ| = {trunk.get('max_delta')}",
            trunk.get("bitwise_equal") is True,
        ),
    ]


def _gradient_differs(name: str, record: Record, ctx: _Context) -> list[Check]:
    deltas = list(record.get("grad_delta") or [])
    steps = ctx.compared_steps(name)
    positive = [d for d in deltas if d is not None and d > 0.0]
    return [
        check(
            name,
            "trunk gradient differs from the compared run's at every step",
            f"max|Δ| > 0 at all {steps} steps",
            f"{len(positive)}/{len(deltas)} steps > 0, smallest {smallest(deltas)}",
            bool(deltas) and len(positive) == len(deltas) == steps,
        )
    ]


def _learns(name: str, record: Record, ctx: _Context, *, output: str) -> list[Check]:
    test, chance = record.get("test") or {}, record.get("chance") or {}
    acc, floor = test.get(f"acc/{output}"), chance.get(f"acc/{output}")
    what = "the main head" if output == "main" else f"the {output} branch"
    return [
        check(
            name,
            f"{what} learns",
            f"test accuracy above chance ({fmt(floor, '.3f')})",
            fmt(acc, ".3f"),
            acc is not None and floor is not None and acc > floor,
        )
    ]


def _stops_with(
    name: str, record: Record, ctx: _Context, *, error: str, mentions: str = "", step: int = 0
) -> list[Check]:
    got = record.get("error", {})
    message = str(got.get("message", ""))
    return [
        check(
            name,
            f"stops after {step} steps with the guard's error naming the branch",
            f"{error} mentioning {mentions}",
            f"{got.get('type', record.get('status'))} after {record.get('steps')} steps: "
            f"{message[:120]}",
            got.get("type") == error and mentions in message and record.get("steps") == step,
        )
    ]


def _drift_series(record: Record, what: Sequence[str]) -> dict[str, list[float]]:
    unknown = sorted(set(what) - set(_DRIFT))
    if unknown:
        raise ValueError(f"drift: unknown {unknown}; choose from {sorted(_DRIFT)}")
    drift = record.get("drift") or {}
    return {w: list(drift.get(_DRIFT[w]) or []) for w in what}


def _still(name: str, record: Record, ctx: _Context, *, what: Sequence[str]) -> list[Check]:
    series = _drift_series(record, what)
    steps = max((len(v) for v in series.values()), default=0)
    observed = ", ".join(f"max|Δ| = {largest(v)} ({w})" for w, v in series.items())
    return [
        check(
            name,
            " and ".join(_DRIFT_TEXT[w] for w in what) + " never move",
            "max|Δ| == 0.0 at every step",
            f"{observed} over {steps} steps",
            all(v and all(d == 0.0 for d in v) for v in series.values()),
        )
    ]


def _moves(name: str, record: Record, ctx: _Context, *, what: str, why: str = "") -> list[Check]:
    values = _drift_series(record, [what])[what]
    because = f" ({why})" if why else ""
    return [
        check(
            name,
            f"{_DRIFT_TEXT[what]} move anyway{because}",
            "max|Δ| > 0",
            f"max|Δ| = {largest(values)}",
            bool(values) and max(values) > 0.0,
        )
    ]


def _thaws(name: str, record: Record, ctx: _Context, *, layer: str, step: int) -> list[Check]:
    layers = record.get("drift_layers") or {}
    series = list(layers.get(layer) or [])
    at = (record.get("thaw") or {}).get("step")
    before, after = series[:step], series[step:]
    moved = [d for d in after if d is not None and d > 0.0]
    others = {k: v for k, v in layers.items() if k != layer}
    still = [d for v in others.values() for d in v]
    return [
        check(
            name,
            f"trunk.{layer} is still before its thaw and moves from then on",
            f"thawed at step {step}; max|Δ| == 0.0 before, > 0 at every step after",
            f"thawed at step {at}; before: max|Δ| = {largest(before)} over {len(before)} "
            f"steps; after: {len(moved)}/{len(after)} steps > 0, smallest {smallest(after)}",
            at == step
            and len(before) == step
            and all(d == 0.0 for d in before)
            and bool(after)
            and len(moved) == len(after),
        ),
        check(
            name,
            f"the rest of the trunk ({len(others)} layers) never moves",
            "max|Δ| == 0.0 at every step",
            f"max|Δ| = {largest(still)} over {len(series)} steps ("
            + ", ".join(f"trunk.{k}" for k in others)
            + ")",
            bool(others) and all(v and all(d == 0.0 for d in v) for v in others.values()),
        ),
    ]


def _ranks_equal(name: str, record: Record, ctx: _Context) -> list[Check]:
    thaw = record.get("thaw") or {}
    steps, differing = list(thaw.get("checked_steps") or []), list(thaw.get("differing") or [])
    world, count = thaw.get("world_size"), thaw.get("parameters")
    same = [d for d in differing if d == 0]
    if not thaw:
        observed = "not recorded (no thaw schedule)"
    elif not steps:
        observed = "no step after a thaw"
    elif world == 1:
        observed = f"1 process: trivially identical ({len(steps)} steps after the thaw)"
    else:
        observed = (
            f"{len(same)}/{len(steps)} steps with all {count} parameters bitwise equal on "
            f"{world} processes" + (f"; most differing: {max(differing)}" if differing else "")
        )
    return [
        check(
            name,
            "every process holds the same full parameters after the thaw",
            "fingerprints equal on every process at every step from the thaw on",
            observed,
            bool(steps) and len(differing) == len(steps) and len(same) == len(steps),
        )
    ]


def _final_std(record: Record | None) -> tuple[float | None, float | None]:
    train = (record or {}).get("train") or {}
    std, ref = train.get("z_std") or [None], train.get("z_std_ref") or [None]
    return std[-1], ref[-1]


def _spread(name: str, record: Record, ctx: _Context, *, factor: float = 0.5) -> list[Check]:
    std, reference = _final_std(record)
    return [
        check(
            name,
            "with the stop-gradient the output stays spread out",
            f"final std of z/|z| > {factor} x 1/sqrt(dim) ({fmt(reference)})",
            fmt(std),
            std is not None and reference is not None and std > factor * reference,
        )
    ]


def _collapses(
    name: str, record: Record, ctx: _Context, *, versus: str, factor: float = 0.5
) -> list[Check]:
    std, reference = _final_std(record)
    other, _ = _final_std(ctx.runs.get(versus))
    return [
        check(
            name,
            f"the output collapses: its spread falls far below {versus}'s",
            f"final std of z/|z| < {factor} x {versus}'s",
            f"{fmt(std)} against {fmt(other)} (1/sqrt(dim) = {fmt(reference)})",
            std is not None and other is not None and std < factor * other,
        )
    ]


def _cut_off(
    name: str, record: Record, ctx: _Context, *, expect: str | Sequence[str]
) -> list[Check]:
    cut = record.get("cut_off")
    found = list((cut or {}).get("parameters") or {})
    if cut is None:
        observed = "not audited"
    elif found:
        observed = ", ".join(found)
    else:
        observed = f"none of {cut.get('trainable')} trainable"
    if expect == "none":
        return [
            check(
                name,
                "no trainable parameter is cut off from the loss at step 0 (graph audit)",
                "none",
                observed,
                cut is not None and not found,
            )
        ]
    if isinstance(expect, str) or not expect or not all(isinstance(e, str) for e in expect):
        raise ValueError(f"cut_off: expect={expect!r} must be 'none' or a list of parameter names")
    changed = (cut or {}).get("changed")
    return [
        check(
            name,
            "exactly these parameters are cut off from the loss at step 0 (graph audit)",
            ", ".join(expect),
            observed,
            cut is not None and sorted(found) == sorted(expect),
        ),
        check(
            name,
            "the cut-off parameters keep their step-0 values to the end",
            f"{len(expect)} of {len(expect)} bitwise unchanged",
            "n/a"
            if changed is None
            else f"{len(found) - len(changed)} of {len(found)} bitwise unchanged"
            + (f"; changed: {', '.join(changed)}" if changed else ""),
            changed is not None and bool(found) and not changed,
        ),
    ]


def _contract(
    name: str, record: Record, ctx: _Context, *, contract: str, holds: bool, clause: str = ""
) -> list[Check]:
    verdict = (record.get("contracts") or {}).get(contract)
    clauses = (verdict or {}).get("clauses", {})
    broken = {c: v for c, v in clauses.items() if v["violated"]}
    unchecked = [c for c, v in clauses.items() if not v["checked"]]
    if verdict is None:
        observed = "not declared"
    elif broken:
        observed = "; ".join(
            f"'{c}' broken at {v['violated']} of {v['checked']} checks" for c, v in broken.items()
        )
    else:
        observed = f"all {len(clauses)} clauses held at every check" + (
            f" (never checked: {', '.join(unchecked)})" if unchecked else ""
        )
    if holds:
        return [
            check(
                name,
                f"contract {contract} holds",
                "every clause checked, none broken",
                observed,
                verdict is not None and not broken and not unchecked,
            )
        ]
    if not clause:
        raise ValueError(f"contract: holds=false needs the clause that must break ({contract})")
    return [
        check(
            name,
            f"contract {contract} breaks its clause '{clause}'",
            f"'{clause}' broken",
            observed,
            clause in broken,
        )
    ]


CLAIMS: dict[str, Callable[..., list[Check]]] = {
    "reaches": _reaches,
    "gradient_equal": _gradient_equal,
    "gradient_differs": _gradient_differs,
    "learns": _learns,
    "stops_with": _stops_with,
    "still": _still,
    "moves": _moves,
    "thaws": _thaws,
    "ranks_equal": _ranks_equal,
    "spread": _spread,
    "collapses": _collapses,
    "cut_off": _cut_off,
    "contract": _contract,
}


def evaluate_checks(results: Mapping[str, Any]) -> list[Check]:
    """Every declared claim of every run in ``results``, in run order.

    Args:
        results: what :func:`experiments.suite.run_suite` gathers: ``runs`` (the records),
            ``variants`` (the declarations) and ``trunk_vs_reference``.

    Returns:
        One dict per check: ``variant``, ``check``, ``expected``, ``observed``, ``ok``.

    Raises:
        ValueError: a declaration names an unknown claim kind.
    """
    ctx = _Context(results)
    checks: list[Check] = []
    for name, record in ctx.runs.items():
        declared = ctx.variants.get(name, {})
        if record.get("status") != "ok" and declared.get("expect_error") is None:
            error = record.get("error", {})
            checks.append(
                check(
                    name,
                    "the run finishes",
                    "status ok",
                    f"{error.get('type')}: {str(error.get('message'))[:200]}",
                    False,
                )
            )
            continue
        for claim in declared.get("claims", []):
            params = {k: v for k, v in claim.items() if k != "check"}
            kind = claim["check"]
            if kind not in CLAIMS:
                raise ValueError(f"{name}: unknown claim {kind!r}; known: {sorted(CLAIMS)}")
            checks += CLAIMS[kind](name, record, ctx, **params)
    return checks
