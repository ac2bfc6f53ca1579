"""What the tests of the experiments share: where the data is, the variants, a few steps."""

from __future__ import annotations

import pytest

from experiments.variants import discover
from tests._launch import REPO

# The README's layout: the shared data folder beside the repository (the MNIST test split).
SHARED_DATA = REPO.parent / "shared" / "data"


VARIANTS = discover()


needs_data = pytest.mark.skipif(
    not (SHARED_DATA / "MNIST" / "raw").is_dir(),
    reason="needs the MNIST test split in ../shared/data beside the repository",
)


# A few steps are enough where the point is the machinery, not the claims.
FIVE_STEPS = ["--data.limit_train=640", "--data.limit_val=128", "--data.limit_test=128"]


# The trunk's parameters before its last layer: conv, BatchNorm, conv, BatchNorm.
BEFORE_THE_LAST_LAYER = [
    "trunk.0.weight",
    "trunk.1.weight",
    "trunk.1.bias",
    "trunk.4.weight",
    "trunk.5.weight",
    "trunk.5.bias",
]
