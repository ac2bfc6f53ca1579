"""Mutation testing of isolate, one module at a time (mutmut 3).

``[tool.mutmut]`` in pyproject.toml covers the whole package: ``mutmut run`` from the
repository root mutates every module of ``isolate/`` and first traces the fast test folders
to learn which tests call which function. On 2 cores that is many hours (about 17,000
mutants), so this script runs one module in its own working folder,
``.mutation/<module>/``, with only the tests that exercise that module for the tracing pass
(mutmut then runs, for each mutant, only the tests that called the mutated function).
Each folder keeps mutmut's cache, so a second run resumes where the first stopped and
``mutmut results`` / ``mutmut show NAME`` work inside it.

    python .ci/mutation.py count                      # mutants per module, nothing is run
    python .ci/mutation.py run isolate/cutoff.py      # mutate one module against its tests
    python .ci/mutation.py results isolate/cutoff.py  # survivors of the last run
    python .ci/mutation.py show isolate/cutoff.py NAME  # the diff of one mutant
    python .ci/mutation.py survivors isolate/cutoff.py  # the diff of every survivor
    python .ci/mutation.py table                      # verdicts of every module run so far

A stratified random sample over the whole package, in rounds (``ROUNDS``): each round draws
``k`` mutants per module with its own seed from the names no earlier round drew, runs them in
its own folder (``.mutation/sample/``, ``.mutation/sample2/``, ...) traced once against the
package's whole test selection, and keeps its draw, mutmut's verdicts and the survivors'
verdicts given by hand in ``.ci/mutation_sample.json``:

    python .ci/mutation.py sample --round 2 --list    # the names drawn; nothing is run
    python .ci/mutation.py sample --round 2 --save    # record the draw and verdicts so far
    python .ci/mutation.py sample --round 2 --max-children 1 --pending   # run what is left
    python .ci/mutation.py sample --round 2 --show    # the diff of every survivor
    python .ci/mutation.py sample-table               # each round, then all rounds together

``run`` and ``sample`` take ``--max-children N`` (default 2) and run mutmut under ``nice``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutation"

# The tests that exercise each module. A module not listed here is traced against the test
# file that mirrors it (tests/<layer>/test_<name>.py) or, failing that, its layer's folder.
TESTS: dict[str, list[str]] = {
    # The element-wise arithmetic of drift (dense, sparse, integer, complex, NaN).
    "isolate/_delta.py": [
        "tests/toolkit/test_delta.py",
        "tests/toolkit/test_drift.py",
        "tests/toolkit/test_fingerprints.py",
    ],
    # The flag flip behind freeze / unfreeze / restore (and the handle numbering).
    "isolate/_flags.py": [
        "tests/toolkit/test_flags.py",
        "tests/toolkit/test_freezing.py",
        "tests/toolkit/test_freezing_properties.py",
        "tests/toolkit/test_exception_safety.py",
    ],
    "isolate/fingerprints.py": [
        "tests/toolkit/test_fingerprints.py",
        "tests/toolkit/test_fingerprint_routes.py",
        "tests/toolkit/test_drift.py",
        "tests/toolkit/test_copies.py",
    ],
    "isolate/cutoff.py": [
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_cutoff_reasons.py",
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audit_properties.py",
        "tests/toolkit/test_audits_in_use.py",
    ],
    # Every test file that builds a sharded or wrapped model in one process (a fake FSDP2
    # state, a DTensor, a flat parameter, an FSDP1 unit) or compares sharded parameters.
    "isolate/_sharding.py": [
        "tests/toolkit/test_sharding.py",
        "tests/toolkit/test_sharding_stand_ins.py",
        "tests/toolkit/test_walker.py",
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_drift.py",
        "tests/toolkit/test_fingerprints.py",
        "tests/toolkit/test_fingerprint_routes.py",
        "tests/spec/test_replaced.py",
    ],
    "isolate/exposure.py": [
        "tests/toolkit/test_exposure.py",
        "tests/toolkit/test_exposure_optimizers.py",
        "tests/toolkit/test_freezing.py",
    ],
    # Every test file that walks a graph (the audits, the sharding check, reentrant
    # checkpoints re-run for real and on fake tensors).
    "isolate/reachability.py": [
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audit_properties.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_detaching.py",
        "tests/toolkit/test_gradients.py",
        "tests/toolkit/test_patterns.py",
        "tests/toolkit/test_selectors.py",
        "tests/toolkit/test_sharding.py",
        "tests/toolkit/test_testing.py",
        "tests/seethrough/test_checkpointing.py",
        "tests/seethrough/test_fake_reruns.py",
    ],
    "isolate/_seethrough.py": [
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audit_properties.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_cutoff_reasons.py",
        "tests/toolkit/test_gradients.py",
        "tests/toolkit/test_sharding.py",
        "tests/seethrough/test_checkpointing.py",
        "tests/seethrough/test_fake_reruns.py",
    ],
    # Tree and Names name tensors for selectors, drift, plans, checks and leaving isolate.
    "isolate/_walker.py": [
        "tests/toolkit",
        "tests/spec/test_plan.py",
        "tests/spec/test_checks.py",
        "tests/interop/test_leave.py",
    ],
    "isolate/spec/thawing.py": ["tests/spec"],
    # The Loop is driven by hand in the spec tests and by every hook of the Lightning
    # callback; reentrant checkpoints keep their arguments through it (seethrough).
    "isolate/spec/cadence.py": [
        "tests/spec",
        "tests/lightning",
        "tests/seethrough/test_checkpointing.py",
    ],
    # Schedulers are extended at a thaw by the spec, the Lightning callback's configured
    # schedulers and the converted finetuning-scheduler runs.
    "isolate/spec/lr_schedulers.py": [
        "tests/spec",
        "tests/lightning/test_callback.py",
        "tests/lightning/test_backbone_finetuning.py",
        "tests/interop/test_migrate_fts.py",
        "tests/interop/test_leave.py",
    ],
    # Every spec test applies a spec to an optimizer (find, place, add_group, the link);
    # test_fuzz.py is left out: 23 s of Hypothesis training per mutant of the link.
    "isolate/spec/optimizers.py": [
        *sorted(
            f"tests/spec/{p.name}"
            for p in (ROOT / "tests" / "spec").glob("test_*.py")
            if p.name != "test_fuzz.py"
        ),
    ],
    # Ramps and plateaus are driven by hand in the spec tests (handle.step, optimizer steps),
    # by the Lightning callback's validation metrics, and by finetuning-scheduler's phases
    # converted (carry_best, after_previous).
    "isolate/spec/clock.py": [
        "tests/spec/test_clock.py",
        "tests/spec/test_handle.py",
        "tests/spec/test_misuse.py",
        "tests/spec/test_optimizers.py",
        "tests/spec/test_lr_schedulers.py",
        "tests/spec/test_attaching.py",
        "tests/lightning/test_callback_errors.py",
        "tests/interop/test_migrate_fts.py",
    ],
    # The saved state is written and checked by the handle's state_dict / load_state_dict and
    # by the Lightning callback's checkpoints (test_resume re-runs whole fits: too slow here).
    "isolate/spec/state.py": [
        "tests/spec/test_state.py",
        "tests/spec/test_misuse.py",
        "tests/spec/test_clock.py",
        "tests/spec/test_contract_bugs.py",
        "tests/spec/test_attaching.py",
        "tests/spec/test_handle.py",
        "tests/lightning/test_checkpoint.py",
        "tests/lightning/test_callback_errors.py",
    ],
    # Every check of a handle runs here (drift, reach, flags, optimizers, contracts);
    # test_fuzz.py is left out: 23 s of Hypothesis training per mutant of run_checks.
    "isolate/spec/checks.py": [
        *sorted(
            f"tests/spec/{p.name}"
            for p in (ROOT / "tests" / "spec").glob("test_*.py")
            if p.name != "test_fuzz.py"
        ),
    ],
    # check_replaced runs in every check of a handle, but only these replace, remove or
    # re-register a parameter after the spec was applied (and attach or thaw after it).
    "isolate/spec/identity.py": [
        "tests/spec/test_replaced.py",
        "tests/spec/test_attaching.py",
        "tests/spec/test_checks.py",
        "tests/spec/test_ranks.py",
        "tests/lightning/test_replaced.py",
    ],
    "isolate/spec/handle.py": ["tests/spec"],
    # The handle's rooms: every spec test applies, attaches and verifies through them.
    "isolate/spec/verifier.py": ["tests/spec"],
    "isolate/spec/attaching.py": ["tests/spec"],
    "isolate/spec/isolation.py": ["tests/spec", "tests/toolkit/test_sharding.py"],
    # check_ranks and replica_key are called in one process only by test_ranks (the exchange
    # replaced); world_size by every check of a handle (cadence, checks) and after a
    # one-process group (test_replaced).
    "isolate/spec/ranks.py": ["tests/spec"],
    # The converter is called directly (test_migrate), against finetuning-scheduler itself
    # (test_migrate_fts), and through the migrate verb's options and errors (test_cli).
    "isolate/interop/migrate.py": [
        "tests/interop/test_migrate.py",
        "tests/interop/test_migrate_fts.py",
        "tests/toolkit/test_cli.py",
    ],
    # plain_checkpoint and plain_optimizer_state: leaving isolate, and a converted
    # finetuning-scheduler run leaving it with what configure_optimizers returns.
    "isolate/interop/leave.py": [
        "tests/interop/test_leave.py",
        "tests/interop/test_migrate_fts.py",
    ],
    # The Lightning integration: every fast test of it calls the strategy checks, the
    # package lookup and the saved state (13 s in all); the Trainer tests build tiny models.
    "isolate/lightning/strategies.py": ["tests/lightning"],
    "isolate/lightning/_compat.py": ["tests/lightning"],
    "isolate/lightning/checkpoint.py": ["tests/lightning"],
    # The callback's helpers (named losses, the checks before a fit, the logged norms and
    # figures, what it tells the user) are called through its hooks in every Trainer test.
    "isolate/lightning/losses.py": ["tests/lightning"],
    "isolate/lightning/preflight.py": ["tests/lightning"],
    "isolate/lightning/metrics.py": ["tests/lightning"],
    "isolate/lightning/notices.py": ["tests/lightning"],
    # Every Trainer test of the callback's hooks, but not test_resume (half of the folder's
    # test time, re-run by every survivor; the resume survivors are checked against it by hand)
    # nor test_unified (the same fits again under both Lightning packages).
    "isolate/lightning/callback.py": [
        "tests/lightning/test_callback.py",
        "tests/lightning/test_callback_errors.py",
        "tests/lightning/test_contracts_callback.py",
        "tests/lightning/test_checkpoint.py",
        "tests/lightning/test_replaced.py",
        "tests/lightning/test_losses.py",
        "tests/lightning/test_metrics.py",
        "tests/lightning/test_notices.py",
        "tests/lightning/test_preflight.py",
        "tests/lightning/test_strategies.py",
        "tests/lightning/test_backbone_finetuning.py",
    ],
    # what_trains is called only by these (the fault matrix never calls it).
    "isolate/peft/report.py": ["tests/peft/test_spec.py", "tests/peft/test_report.py"],
    # spec_for and check_flags are called in one process by the spec tests and the example
    # under transformers' Trainer; the fault matrix (a minute of fits per mutant) is left out.
    "isolate/peft/spec.py": ["tests/peft/test_spec.py", "tests/transformers/test_example.py"],
    # layout is read by spec_for, check_flags and what_trains (the fault matrix left out).
    "isolate/peft/layout.py": [
        "tests/peft/test_layout.py",
        "tests/peft/test_spec.py",
        "tests/peft/test_report.py",
        "tests/transformers/test_example.py",
    ],
    # The Trainer adapter's checks and method wrappers: the callback's tests call each of them
    # (the resume tests only for a checkpoint's saved state: one resumed run and the refusals).
    "isolate/transformers/trainer.py": [
        "tests/transformers/test_callback.py",
        "tests/transformers/test_resume.py::test_a_resumed_run_equals_the_uninterrupted_one[thawed-before-the-checkpoint]",
        "tests/transformers/test_resume.py::test_a_resume_under_another_spec_is_refused",
        "tests/transformers/test_resume.py::test_a_resume_from_a_checkpoint_without_the_callback_is_refused",
    ],
    # The callback's events under a real Trainer, and its state in resumed runs (every resume
    # case: epoch, step and monitor thaws; the checkpointing and example files add nothing).
    "isolate/transformers/callback.py": [
        "tests/transformers/test_callback.py",
        "tests/transformers/test_resume.py",
    ],
    # Every handle wraps its plan's branches; the callbacks and leaving isolate unwrap them.
    "isolate/spec/branches.py": [
        "tests/spec",
        "tests/interop/test_leave.py",
        "tests/lightning/test_callback.py",
        "tests/lightning/test_callback_errors.py",
    ],
    # Specs and contracts are built from YAML and dicts by the spec, the interop converters
    # (migrate, schedules) and the command line.
    "isolate/spec/_fields.py": ["tests/spec", "tests/interop", "tests/toolkit/test_cli.py"],
    "isolate/spec/thaw.py": ["tests/spec", "tests/interop", "tests/toolkit/test_cli.py"],
    # load_model and to_yaml also serve the migrate verb; every verb runs through the command.
    "isolate/interop/schedules.py": [
        "tests/interop/test_schedules.py",
        "tests/interop/test_migrate.py",
        "tests/toolkit/test_cli.py",
    ],
    # The fake re-runs of checkpointed segments are the only callers of these.
    "isolate/_rerun_safety.py": [
        "tests/toolkit/test_rerun_safety.py",
        "tests/seethrough/test_fake_reruns.py",
        "tests/seethrough/test_checkpointing.py",
    ],
    # Every verb's parser and errors, reached through main().
    "isolate/cli.py": [
        "tests/toolkit/test_cli.py",
        "tests/interop/test_schedules.py",
        "tests/interop/test_migrate.py",
        "tests/interop/test_migrate_fts.py",
    ],
    # Every toolkit file that freezes, nests, copies or refuses (a handle's restore order,
    # its copies, the holds of mode-dependent layers, a Frozen module's forward); the spec
    # thaws through FreezeHandle too, and checks a restore before it undoes anything.
    # The frame walk of warn_user is checked by test_warning_frames (deselected under mutmut:
    # its trampolines add a frame); the mutants it alone kills are counted outside the selection.
    "isolate/_text.py": ["tests/toolkit/test_text.py", "tests/toolkit/test_warning_frames.py"],
    # The named losses' check: verify's tests, and the handle's loop that calls it.
    "isolate/spec/loss_checks.py": ["tests/spec"],
    # A spec resolved against a model: every spec test resolves one (resolve, its groups, the
    # wraps, the overlap fix, record and expectations), and the mode= holding tests record it.
    # test_fuzz.py is left out: 23 s of Hypothesis training per mutant of resolve.
    "isolate/spec/plan.py": [
        *sorted(
            f"tests/spec/{p.name}"
            for p in (ROOT / "tests" / "spec").glob("test_*.py")
            if p.name != "test_fuzz.py"
        ),
        "tests/toolkit/test_holding.py",
    ],
    # The clauses of each contract kind: the contracts' tests, their checks while training, the
    # bugs they found, the ema and reversal kinds built on them, and the Lightning callback's.
    "isolate/spec/contract_clauses.py": [
        "tests/spec/test_contracts.py",
        "tests/spec/test_contract_checks.py",
        "tests/spec/test_contract_bugs.py",
        "tests/spec/test_ema.py",
        "tests/spec/test_reversal.py",
        "tests/spec/test_cadence.py",
        "tests/spec/test_contract_clauses.py",
        "tests/lightning/test_contracts_callback.py",
    ],
    # A spec's fields, checked when built, as plain data and back, and prefixed: the spec tests
    # that build bad specs or read them back, and the converters that write them.
    "isolate/spec/data.py": [
        "tests/spec/test_data.py",
        "tests/spec/test_fields.py",
        "tests/spec/test_thaw.py",
        "tests/spec/test_thaw_fields.py",
        "tests/spec/test_user_messages.py",
        "tests/spec/test_misuse.py",
        "tests/spec/test_contracts.py",
        "tests/spec/test_walks.py",
        "tests/interop/test_migrate.py",
        "tests/toolkit/test_cli.py",
    ],
    # Contracts as data: their own tests and the corrected implementations that declare them.
    "isolate/spec/contracts.py": [
        "tests/spec/test_contracts.py",
        "tests/spec/test_contract_bugs.py",
    ],
    # The ema contract: the contracts' tests (parsing, checks, the bugs they found) and its own.
    "isolate/spec/ema.py": [
        "tests/spec/test_contracts.py",
        "tests/spec/test_contract_bugs.py",
        "tests/spec/test_ema.py",
    ],
    # gradient_report and gradient_invariance: their own tests, assert_gradient_invariance,
    # the figures drawn from a report, and every audit test that reports on a model (sharded,
    # checkpointed, a transformer's LoRA groups, the bad inputs refused).
    "isolate/gradients.py": [
        "tests/toolkit/test_gradients.py",
        "tests/toolkit/test_testing.py",
        "tests/toolkit/test_figures.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_autograd.py",
        "tests/toolkit/test_patterns.py",
        "tests/toolkit/test_selectors.py",
        "tests/toolkit/test_sharding.py",
        "tests/toolkit/test_reachability.py",
        "tests/seethrough/test_checkpointing.py",
        "tests/seethrough/test_transformers.py",
    ],
    # snapshot and max_abs_diff: their own tests, the testing asserts and audits built on a
    # snapshot (copies, fingerprints, exposure, the patterns), gradient_invariance's deltas,
    # and the spec's drift check (check_drift renews a snapshot, a replaced tensor named).
    "isolate/drift.py": [
        "tests/toolkit/test_drift.py",
        "tests/toolkit/test_testing.py",
        "tests/toolkit/test_copies.py",
        "tests/toolkit/test_fingerprints.py",
        "tests/toolkit/test_delta.py",
        "tests/toolkit/test_patterns.py",
        "tests/toolkit/test_exposure.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_gradients.py",
        "tests/spec/test_checks.py",
        "tests/spec/test_replaced.py",
        "tests/spec/test_verifier.py",
    ],
    # The figures: their own tests and the Lightning callback's logged figures.
    "isolate/figures.py": ["tests/toolkit/test_figures.py", "tests/lightning/test_metrics.py"],
    # The ledger: its own tests, the PEFT report built on it and the callback's printed ledger.
    "isolate/ledger.py": [
        "tests/toolkit/test_ledger.py",
        "tests/peft/test_report.py",
        "tests/lightning/test_notices.py",
    ],
    # What an audit protects: every audit that takes protect= resolves it here.
    "isolate/_protected.py": [
        "tests/toolkit/test_protected.py",
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_gradients.py",
        "tests/toolkit/test_testing.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_patterns.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_selectors.py",
    ],
    # The mode holds: freezing's bn="eval" and every caller that reads or stacks them.
    "isolate/_holding.py": [
        "tests/toolkit/test_holding.py",
        "tests/toolkit/test_freezing.py",
        "tests/toolkit/test_copies.py",
        "tests/toolkit/test_tree.py",
        "tests/toolkit/test_exception_safety.py",
    ],
    "isolate/freezing.py": [
        "tests/toolkit/test_freezing.py",
        "tests/toolkit/test_freezing_properties.py",
        "tests/toolkit/test_holding.py",
        "tests/toolkit/test_copies.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_exception_safety.py",
        "tests/toolkit/test_exposure_optimizers.py",
        "tests/toolkit/test_selectors.py",
        "tests/toolkit/test_tree.py",
        "tests/spec/test_thaw.py",
        "tests/spec/test_handle.py",
    ],
    # Every file that detaches, scales or reverses a gradient, wraps a branch, or walks a
    # graph through those cuts (the audits see a scale of 0 as a cut; reversal contracts
    # read gradient_scale_of).
    "isolate/detaching.py": [
        "tests/toolkit/test_detaching.py",
        "tests/toolkit/test_cloning.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_tree.py",
        "tests/toolkit/test_patterns.py",
        "tests/toolkit/test_wrapping.py",
        "tests/toolkit/test_copies.py",
        "tests/toolkit/test_audit_properties.py",
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_testing.py",
        "tests/spec/test_contracts.py",
        "tests/spec/test_contract_bugs.py",
    ],
    "isolate/cloning.py": [
        "tests/toolkit/test_cloning.py",
        "tests/toolkit/test_detaching.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_tree.py",
        "tests/toolkit/test_wrapping.py",
        "tests/toolkit/test_copies.py",
        "tests/spec/test_branches.py",
    ],
    # assert_unchanged is also what the drift and pattern tests check a step with.
    "isolate/testing.py": [
        "tests/toolkit/test_testing.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_drift.py",
        "tests/toolkit/test_patterns.py",
    ],
    # Every certificate test builds, opens and judges checkpoints through certify() or the
    # command line (about 5 s in all for the fast ones), so the whole folder traces each.
    "isolate/certificates/filehash.py": ["tests/certificates"],
    "isolate/certificates/opening.py": ["tests/certificates"],
    "isolate/certificates/engine.py": ["tests/certificates"],
    "isolate/certificates/merge.py": ["tests/certificates"],
    "isolate/certificates/checkpoint.py": ["tests/certificates"],
    "isolate/certificates/certificate.py": ["tests/certificates"],
    "isolate/certificates/streaming.py": ["tests/certificates"],
    "isolate/certificates/verdicts.py": ["tests/certificates"],
    "isolate/certificates/structure.py": ["tests/certificates"],
    "isolate/certificates/claims.py": ["tests/certificates"],
    # Only these reach diff_rows / is_constant / row_blocks / as_bits (through the verdicts,
    # the structure checks and merge); the other certificate tests never call compare.
    "isolate/certificates/compare.py": [
        "tests/certificates/test_compare.py",
        "tests/certificates/test_cli.py",
        "tests/certificates/test_corruptions.py",
        "tests/certificates/test_engine.py",
        "tests/certificates/test_formats.py",
        "tests/certificates/test_lightning.py",
        "tests/certificates/test_merge.py",
        "tests/certificates/test_one_pass.py",
        "tests/certificates/test_peft.py",
        "tests/certificates/test_structure.py",
        "tests/certificates/test_verdicts.py",
    ],
    # The files that certify a LoRA merge (adapter_config=, or --adapter-config for the CLI).
    "isolate/certificates/peft.py": [
        "tests/certificates/test_peft.py",
        "tests/certificates/test_errors.py",
        "tests/certificates/test_corruptions.py",
        "tests/certificates/test_verdicts.py",
        "tests/certificates/test_cli.py",
    ],
    # The files that call certify() (or the CLI on it); the others test readers alone.
    "isolate/certificates/api.py": [
        "tests/certificates/test_claims.py",
        "tests/certificates/test_cli.py",
        "tests/certificates/test_corruptions.py",
        "tests/certificates/test_engine.py",
        "tests/certificates/test_errors.py",
        "tests/certificates/test_formats.py",
        "tests/certificates/test_lightning.py",
        "tests/certificates/test_one_pass.py",
        "tests/certificates/test_peft.py",
        "tests/certificates/test_structure.py",
        "tests/certificates/test_verdicts.py",
    ],
    # The files that write or open a torch.distributed.checkpoint folder (the dcp format);
    # test_sharded.py's are all slow (two ranks), so left out.
    "isolate/certificates/dcp_folder.py": [
        "tests/certificates/test_dcp_folder.py",
        "tests/certificates/test_corruptions.py",
        "tests/certificates/test_errors.py",
        "tests/certificates/test_formats.py",
        "tests/certificates/test_one_pass.py",
        "tests/certificates/test_opening.py",
        "tests/certificates/test_verdicts.py",
    ],
    # The command line's parsing errors are also checked with the package's other commands;
    # only these two files call the certify command (its main, or the isolate parser).
    "isolate/certificates/cli.py": [
        "tests/certificates/test_cli.py",
        "tests/toolkit/test_cli.py",
    ],
    # Every file that wraps a module (Frozen, Detached, Cloned), copies or pickles a wrapper,
    # loads its state_dict, or wraps one twice (the mirror test file has six tests).
    "isolate/_wrapping.py": [
        "tests/toolkit/test_wrapping.py",
        "tests/toolkit/test_detaching.py",
        "tests/toolkit/test_cloning.py",
        "tests/toolkit/test_freezing.py",
        "tests/toolkit/test_copies.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_tree.py",
        "tests/toolkit/test_exception_safety.py",
    ],
    # The walk under every audit: the files that walk graphs (as reachability's), with the
    # ledger's and the cutoff reasons' (they read the walk's paths and connecting ops).
    "isolate/_autograd.py": [
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audit_properties.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_cutoff_reasons.py",
        "tests/toolkit/test_detaching.py",
        "tests/toolkit/test_gradients.py",
        "tests/toolkit/test_ledger.py",
        "tests/toolkit/test_patterns.py",
        "tests/toolkit/test_selectors.py",
        "tests/toolkit/test_sharding.py",
        "tests/toolkit/test_testing.py",
        "tests/seethrough/test_checkpointing.py",
        "tests/seethrough/test_fake_reruns.py",
    ],
    # The file formats are read by the certificate's whole layer (opening, corruptions, one
    # pass, errors), not only by their mirror files.
    # Selectors are resolved by freeze (and its holds), the spec's fields, and read over
    # checkpoint keys (select_names) by the certificates' claims and errors.
    "isolate/_selectors.py": [
        "tests/toolkit/test_selectors.py",
        "tests/toolkit/test_freezing.py",
        "tests/toolkit/test_freezing_properties.py",
        "tests/toolkit/test_holding.py",
        "tests/spec/test_fields.py",
        "tests/certificates/test_errors.py",
        "tests/certificates/test_certificate.py",
        "tests/certificates/test_peft.py",
    ],
    # The structures the wrappers map (Detached, Cloned, scale_gradient) and Frozen's
    # forward walks, with the inputs they refuse.
    "isolate/_tree.py": [
        "tests/toolkit/test_tree.py",
        "tests/toolkit/test_detaching.py",
        "tests/toolkit/test_cloning.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_wrapping.py",
        "tests/toolkit/test_freezing.py",
    ],
    "isolate/certificates/safetensors_file.py": ["tests/certificates"],
    "isolate/certificates/torch_file.py": ["tests/certificates"],
    # Reentrant checkpoints re-run for a walk or a gradient: the files that build them (the
    # see-through tests, the transformers' gradient checkpointing, the audits that walk them,
    # the named losses through a segment); the default (tests/toolkit) would trace them all.
    "isolate/_checkpointing.py": [
        "tests/seethrough/test_checkpointing.py",
        "tests/seethrough/test_fake_reruns.py",
        "tests/seethrough/test_transformers.py",
        "tests/transformers/test_checkpointing.py",
        "tests/spec/test_loss_checks.py",
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_cutoff_reasons.py",
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audit_properties.py",
    ],
    # Compiled regions are read only under torch.compile. Dynamo never traces this module (the
    # walks read a compiled node after the forward), so with only it mutated the dynamo tests
    # run under mutmut: the audits of compiled regions and the flips between compiled steps;
    # in plain mode the walks ask is_compiled, gradients compiled_in and thaws forget_compiled.
    # Not the guard-filter test: its child imports the trampolines without mutmut's config.
    "isolate/_compiled.py": [
        "tests/seethrough/test_compiled.py",
        "tests/seethrough/test_compile_thaw.py::test_a_flip_between_steps_trains_as_in_eager",
        "tests/seethrough/test_compile_thaw.py::test_a_thaw_under_inductor_trains_as_in_eager",
        "tests/toolkit/test_gradients.py",
        "tests/spec/test_thawing.py",
    ],
}


@dataclass(frozen=True)
class Round:
    """One round of the sample: ``k`` more mutants per module, drawn with ``seed`` from the
    names no earlier round drew; a module that had fewer draws than ``k`` per earlier round
    (a module added since) draws up to ``k`` per round so far."""

    number: int
    seed: int
    k: int

    @property
    def folder(self) -> Path:
        """Where the round runs: ``.mutation/sample/``, ``.mutation/sample2/``, ..."""
        return WORK / ("sample" if self.number == 1 else f"sample{self.number}")


# A different seed or k is a different sample (and folder cache); a round's draw is kept in
# SAMPLE_VERDICTS once recorded, so later changes to the tree do not move it.
ROUNDS = (Round(1, 20261201, 3), Round(2, 20261202, 3))

# The draw, mutmut's verdicts and the verdicts given by hand of each round (``rounds``).
SAMPLE_VERDICTS = ".ci/mutation_sample.json"

# Test folders the sample adds to ``[tool.mutmut]``'s selection, so that the integrations
# it leaves out (peft, transformers) are traced too.
SAMPLE_EXTRA_TESTS = ["tests/peft/test_spec.py", "tests/transformers"]

# The order in which the sample's modules are run (a prefix of a path; the rest follow).
PRIORITY = [
    "isolate/_sharding.py",
    "isolate/spec/thawing.py",
    "isolate/spec/optimizers.py",
    "isolate/spec/clock.py",
    "isolate/spec/checks.py",
    "isolate/spec/identity.py",
    "isolate/exposure.py",
    "isolate/spec/",
    "isolate/lightning/",
    "isolate/peft/",
    "isolate/transformers/",
    "isolate/certificates/",
    "isolate/interop/",
    "isolate/",
]


def pytest_args() -> list[str]:
    """The options ``[tool.mutmut]`` gives every pytest run (one list for both ways to run)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["mutmut"]["pytest_add_cli_args"]


def modules() -> list[str]:
    """Every module of the package that has code to mutate, as a path from the root."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "isolate").rglob("*.py")
        if "__pycache__" not in p.parts
    )


def tests_for(module: str) -> list[str]:
    """The test files or folders that trace ``module`` (see ``TESTS``)."""
    if module in TESTS:
        return TESTS[module]
    path = Path(module)
    layer = {"isolate": "toolkit"}.get(path.parent.as_posix(), path.parent.name)
    mirror = Path("tests") / layer / f"test_{path.stem.lstrip('_')}.py"
    if (ROOT / mirror).exists():
        return [mirror.as_posix()]
    return [(Path("tests") / layer).as_posix()]


def mutant_names(module: str) -> list[str]:
    """The module's mutants, named as ``mutmut run`` and ``mutmut show`` take them
    (``isolate.spec.clock.x_ramp__mutmut_3``, ``isolate.cutoff.xǁCutOffǁ__str____mutmut_2``),
    generated in memory: nothing is written or run."""
    from mutmut.mutation.file_mutation import mutate_file_contents

    dotted = module.removesuffix(".py").replace("/", ".")
    generated = mutate_file_contents(module, (ROOT / module).read_text()).mutant_names
    return [f"{dotted}.{name}" for name in generated]


def count() -> dict[str, int]:
    """Mutants per module, generated in memory: nothing is written or run."""
    return {module: len(mutant_names(module)) for module in modules()}


def priority(module: str) -> tuple[int, str]:
    """Where ``module`` comes in the sample's run order (``PRIORITY``)."""
    rank = next(i for i, prefix in enumerate(PRIORITY) if module.startswith(prefix))
    return rank, module


def module_of(name: str) -> str:
    """The module of a mutant's name: ``isolate.spec.clock.x_ramp__mutmut_3`` ->
    ``isolate/spec/clock.py``."""
    parts = name.split(".")
    at = next(i for i, part in enumerate(parts) if part.startswith(("x_", "xǁ")))
    return "/".join(parts[:at]) + ".py"


def by_module(names: list[str]) -> dict[str, list[str]]:
    """Mutants' names grouped by module, modules in run order (``PRIORITY``)."""
    grouped: dict[str, list[str]] = {}
    for name in names:
        grouped.setdefault(module_of(name), []).append(name)
    return dict(sorted(grouped.items(), key=lambda item: priority(item[0])))


def drawn(rnd: Round) -> dict[str, list[str]]:
    """The round's mutants by module: the draw recorded in ``SAMPLE_VERDICTS`` (a draw made
    on an older tree stays the sample its verdicts are about) or, if none, ``draw(rnd)``."""
    names = record(rnd).get("drawn")
    return by_module(names) if names else draw(rnd)


def draw(rnd: Round) -> dict[str, list[str]]:
    """The round's draw on the current tree, without replacement across rounds.

    Each module draws from its own generator, seeded with the round's seed and its path, so
    the sample of one module does not change when another module gains or loses mutants.
    """
    earlier = sorted(n for r in ROUNDS[: rnd.number - 1] for ns in drawn(r).values() for n in ns)
    taken = by_module(earlier)
    digest = hashlib.sha256(f"{rnd.seed}:{rnd.k}:{earlier}".encode())
    for module in modules():
        digest.update(module.encode() + (ROOT / module).read_bytes())
    cache = rnd.folder / f"draw-{rnd.k}-{digest.hexdigest()[:16]}.json"
    if cache.exists():
        cached: dict[str, list[str]] = json.loads(cache.read_text())
        return cached
    sample = {}
    for module in sorted(modules(), key=priority):
        names = sorted(set(mutant_names(module)).difference(earlier))
        want = rnd.k * rnd.number - len(taken.get(module, []))
        if names and want > 0:
            rng = random.Random(f"{rnd.seed}:{module}")
            sample[module] = sorted(rng.sample(names, min(want, len(names))))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(sample, indent=1))
    return sample


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``successes / n`` ((0, 1) if n is 0).

    >>> [round(x, 3) for x in wilson(3, 3)]
    [0.439, 1.0]
    """
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def folder(module: str) -> Path:
    """``.mutation/<module>/``, where one module's mutants run (``isolate.cutoff``)."""
    return WORK / module.removesuffix(".py").replace("/", ".")


def workdir(module: str, *, only: list[str] | None = None, tests: list[str] | None = None) -> Path:
    """``.mutation/<module>/`` set up for mutmut: the package and the tests linked in, and a
    pyproject.toml whose ``[tool.mutmut]`` names this module and its tests (or, for the
    folder ``sample``, the modules ``only`` and the tests ``tests``)."""
    where = folder(module)
    only = only if only is not None else [module]
    tests = tests if tests is not None else tests_for(module)
    where.mkdir(parents=True, exist_ok=True)
    for name in ("isolate", "tests", "experiments", "examples", "configs"):
        link = where / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    text = (ROOT / "pyproject.toml").read_text()
    text = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[)", "", text)
    text += (
        "\n[tool.mutmut]\n"
        'source_paths = ["isolate"]\n'
        f"only_mutate = {json.dumps(only)}\n"
        f"pytest_add_cli_args = {json.dumps(pytest_args())}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'also_copy = ["experiments", "examples", "configs"]\n'
        'process_isolation = "forkserver"\n'
    )
    target = where / "pyproject.toml"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    return where


def exit_codes(folder: Path, module: str) -> dict[str, int | None]:
    """mutmut's exit code of each of the module's mutants in ``folder`` (None: not run)."""
    meta = folder / "mutants" / f"{module}.meta"
    return json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}


def tally(module: str) -> dict[str, int]:
    """The module's verdicts so far, by mutmut status ({} if it never ran)."""
    from mutmut.stats import status_by_exit_code

    counts: dict[str, int] = {}
    for code in exit_codes(folder(module), module).values():
        status = status_by_exit_code[code]
        counts[status] = counts.get(status, 0) + 1
    return counts


def survivors(module: str) -> list[str]:
    """The names of the module's surviving mutants."""
    return sorted(name for name, code in exit_codes(folder(module), module).items() if code == 0)


def mutmut(module: str, *args: str, where: Path | None = None, niceness: int = 5) -> int:
    """Run ``mutmut ARGS`` in the module's working folder (or in ``where``)."""
    binary = Path(sys.executable).with_name("mutmut")
    command = ["nice", "-n", str(niceness), str(binary), *args]
    cwd = where if where is not None else workdir(module)
    return subprocess.call(command, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def sample_dir(rnd: Round, sample: dict[str, list[str]]) -> Path:
    """The round's folder: every sampled module mutated, traced once against the package's
    whole test selection (``[tool.mutmut]``'s plus ``SAMPLE_EXTRA_TESTS``)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        selection = tomllib.load(f)["tool"]["mutmut"]["pytest_add_cli_args_test_selection"]
    tests = [*selection, *SAMPLE_EXTRA_TESTS]
    return workdir(rnd.folder.name, only=sorted(sample), tests=tests)


def statuses(rnd: Round, sample: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """mutmut's verdict of each of the round's mutants, by module: read in the round's folder,
    or as recorded in ``SAMPLE_VERDICTS`` where the folder has none ("not checked")."""
    from mutmut.stats import status_by_exit_code

    saved = record(rnd).get("status", {})
    verdicts = {}
    for module, names in sample.items():
        codes = exit_codes(rnd.folder, module)
        found = {name: status_by_exit_code[codes.get(name)] for name in names}
        verdicts[module] = {
            name: saved.get(name, "not checked") if status == "not checked" else status
            for name, status in found.items()
        }
    return verdicts


def git(*args: str) -> str:
    return subprocess.check_output(["git", *args], cwd=ROOT, text=True).strip()


def save(rnd: Round, sample: dict[str, list[str]]) -> None:
    """Record the round's draw (and the tree it was drawn on, if new) and mutmut's verdicts so
    far in ``SAMPLE_VERDICTS``, keeping the verdicts given by hand."""
    path = ROOT / SAMPLE_VERDICTS
    kept = json.loads(path.read_text())["rounds"] if path.exists() else []
    rounds = {(r["seed"], r["k"]): r for r in kept}
    old = rounds.get((rnd.seed, rnd.k), {})
    found = {n: v for vs in statuses(rnd, sample).values() for n, v in vs.items()}
    rounds[rnd.seed, rnd.k] = {
        "seed": rnd.seed,
        "k": rnd.k,
        "tree": old.get("tree") or git("rev-parse", "--short=7", "HEAD"),
        "mutants": old.get("mutants") or count(),
        "drawn": [name for names in sample.values() for name in names],
        "status": {n: v for n, v in found.items() if v != "not checked"},
        **{key: old.get(key, {}) for key in HAND},
    }
    ordered = sorted(rounds.values(), key=lambda r: r["seed"])
    path.write_text(json.dumps({"rounds": ordered}, indent=1, ensure_ascii=False) + "\n")


def sample_table(
    verdicts: dict[str, dict[str, str]], hand: dict[str, dict[str, str]], sizes: dict[str, int]
) -> str:
    """A Markdown table of a sample: per module, mutmut's verdicts, the survivors' verdicts
    given by hand (``hand``, read from ``SAMPLE_VERDICTS``), and the 95% Wilson interval of
    the suite's kill rate over the mutants that ran and are not equivalent; then the
    package's rate weighted by ``sizes``, mutants per module (``weighted``). A timeout
    counts as killed; a mutant that no test of mutmut's selection calls counts as survived,
    and so does one that mutmut saw killed only by a test added for it."""
    rows = [
        "| Module | Sampled | Killed | Survived | No tests | Timeout | Not run | Equivalent"
        " | Killed outside mutmut | Killed by added tests | Suite's kill rate (95% Wilson) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    keys = ("n", "killed", "survived", "no tests", "other", "not", "eq", "outside", "added")
    total = dict.fromkeys(keys, 0)
    rates = {}
    for module, found in verdicts.items():
        row = dict.fromkeys(keys, 0)
        row["n"] = len(found)
        for name, status in found.items():
            if status == "not checked":
                row["not"] += 1
                continue
            if status == "killed" and name in hand["added"]:
                status = "survived"  # mutmut ran it after the test that kills it was added
            row[status if status in ("killed", "survived", "no tests") else "other"] += 1
            if status in ("survived", "no tests"):
                for key, verdict in zip(("eq", "outside", "added"), HAND, strict=True):
                    row[key] += name in hand[verdict]
        for key in keys:
            total[key] += row[key]
        rows.append(f"| `{module}` | {rate_cells(row)}")
        caught = row["killed"] + row["other"]
        rates[module] = (caught, caught + row["survived"] + row["no tests"] - row["eq"])
    rows.append(f"| all | {rate_cells(total)}")
    estimate, spread = weighted(rates, sizes)
    rows.append(f"\nWeighted by mutants per module: {estimate:.2f} ± {spread:.2f}")
    return "\n".join(rows)


def weighted(rates: dict[str, tuple[int, int]], sizes: dict[str, int]) -> tuple[float, float]:
    """The package's kill rate as a stratified estimate: each module's rate ``caught / n``
    weighted by its number of mutants (small modules are over-represented in the sample),
    and the half-width of a 95% normal interval, each module's variance ``p (1 - p) / n``
    with ``p = (caught + 2) / (n + 4)`` (never 0 when a module's mutants are all caught).
    Modules where nothing ran are left out of both.

    >>> [round(x, 3) for x in weighted({"a": (3, 3), "b": (1, 2)}, {"a": 300, "b": 100})]
    [0.875, 0.421]
    """
    ran = {module: r for module, r in rates.items() if r[1] and sizes.get(module)}
    total = sum(sizes[module] for module in ran)
    estimate = variance = 0.0
    for module, (caught, n) in ran.items():
        share = sizes[module] / total
        adjusted = (caught + 2) / (n + 4)
        estimate += share * caught / n
        variance += share * share * adjusted * (1 - adjusted) / n
    return estimate, 1.959964 * math.sqrt(variance)


def rate_cells(row: dict[str, int]) -> str:
    """The cells of one row of ``sample_table`` after the module's name."""
    caught = row["killed"] + row["other"]
    n = caught + row["survived"] + row["no tests"] - row["eq"]
    low, high = wilson(caught, n)
    rate = f"{caught}/{n} [{low:.2f}, {high:.2f}]" if n else "-"
    counts = (row[k] for k in row)
    return " | ".join(map(str, counts)) + f" | {rate} |"


# The verdicts given by hand to a round's survivors: ``equivalent`` (name -> why), ``outside``
# (name -> the test outside mutmut's selection that kills it: dynamo, slow, child processes),
# ``added`` (name -> the test added that kills it).
HAND = ("equivalent", "outside", "added")


def record(rnd: Round) -> dict[str, Any]:
    """The round as recorded in ``SAMPLE_VERDICTS`` ({} if it is not)."""
    path = ROOT / SAMPLE_VERDICTS
    rounds = json.loads(path.read_text())["rounds"] if path.exists() else []
    return next((r for r in rounds if (r["seed"], r["k"]) == (rnd.seed, rnd.k)), {})


def hand_verdicts(rounds: tuple[Round, ...]) -> dict[str, dict[str, str]]:
    """The verdicts given by hand to the survivors of ``rounds``, by kind (``HAND``)."""
    return {key: {n: v for r in rounds for n, v in record(r).get(key, {}).items()} for key in HAND}


def print_tables(rounds: list[Round]) -> None:
    """``sample_table`` of each round, then of all of them together (weighted by the
    mutants per module of the last round's tree)."""
    combined: dict[str, dict[str, str]] = {}
    for rnd in rounds:
        found = statuses(rnd, drawn(rnd))
        print(f"Round {rnd.number}: seed {rnd.seed}, k {rnd.k}, tree {record(rnd).get('tree')}")
        sizes = record(rnd).get("mutants") or count()  # of the tree it was drawn on
        print(sample_table(found, hand_verdicts((rnd,)), sizes) + "\n")
        for module, verdicts in found.items():
            combined.setdefault(module, {}).update(verdicts)
    if len(rounds) > 1:
        print(f"Rounds {', '.join(str(rnd.number) for rnd in rounds)} together")
        combined = dict(sorted(combined.items(), key=lambda item: priority(item[0])))
        print(sample_table(combined, hand_verdicts(tuple(rounds)), sizes))


def sample_command(rnd: Round, args: argparse.Namespace) -> int:
    """``sample``: list, record, show or run the round's mutants (``main``'s options)."""
    sample = drawn(rnd)
    where = sample_dir(rnd, sample)
    if args.save:
        save(rnd, sample)
        return 0
    found = statuses(rnd, sample)
    chosen = [
        name
        for module, names in sample.items()
        if not args.modules or any(module.startswith(m) for m in args.modules)
        for name in names
        if not args.pending or found[module][name] == "not checked"
    ]
    if args.list:
        print("\n".join(chosen))
        return 0
    if args.show:
        for verdicts in found.values():
            for name, status in verdicts.items():
                if name in chosen and status in ("survived", "no tests"):
                    mutmut("sample", "show", name, where=where)
        return 0
    run_args = ("run", "--max-children", str(args.max_children), *chosen)
    return mutmut("sample", *run_args, where=where, niceness=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("count", help="mutants per module; nothing is run")
    run = sub.add_parser("run", help="mutate one module against its tests")
    run.add_argument("module", help="a path such as isolate/cutoff.py")
    run.add_argument("--max-children", type=int, default=2)
    results = sub.add_parser("results", help="the survivors of the module's last run")
    results.add_argument("module")
    show = sub.add_parser("show", help="the diff of one mutant")
    show.add_argument("module")
    show.add_argument("name")
    sub.add_parser("table", help="verdicts per module of every module run so far")
    diffs = sub.add_parser("survivors", help="the diff of every survivor of one module")
    diffs.add_argument("module")
    sample = sub.add_parser("sample", help="run k mutants drawn from every module")
    sample.add_argument("modules", nargs="*", help="only these modules' draws (or prefixes)")
    sample.add_argument("--round", type=int, default=len(ROUNDS), help="default: the last")
    sample.add_argument("--max-children", type=int, default=1)
    sample.add_argument("--list", action="store_true", help="print the names; run nothing")
    sample.add_argument("--pending", action="store_true", help="only those not run yet")
    sample.add_argument("--show", action="store_true", help="the diff of every sampled survivor")
    sample.add_argument("--save", action="store_true", help="record the draw and the verdicts")
    table = sub.add_parser("sample-table", help="per module: the sample's verdicts")
    table.add_argument("--round", type=int, help="only this round (default: each, then all)")
    args = parser.parse_args(argv)

    if args.command == "sample-table":
        print_tables([ROUNDS[args.round - 1]] if args.round else list(ROUNDS))
        return 0
    if args.command == "sample":
        return sample_command(ROUNDS[args.round - 1], args)
    if args.command == "count":
        counts = count()
        for module, n in counts.items():
            print(f"{n:6d}  {module}")
        print(f"{sum(counts.values()):6d}  total")
        return 0
    if args.command == "table":
        for module in modules():
            verdicts = tally(module)
            if verdicts:
                print(module, json.dumps(verdicts, sort_keys=True))
        return 0
    if args.module not in modules():
        parser.error(f"{args.module!r} is not a module of isolate/; e.g. isolate/cutoff.py")
    if args.command == "run":
        return mutmut(args.module, "run", "--max-children", str(args.max_children))
    if args.command == "results":
        return mutmut(args.module, "results")
    if args.command == "survivors":
        for name in survivors(args.module):
            mutmut(args.module, "show", name)
        return 0
    return mutmut(args.module, "show", args.name)


if __name__ == "__main__":
    sys.exit(main())
