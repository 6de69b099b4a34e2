"""fbs.model.skip, the one skip rule: hand-computed decisions, and the native layer's policy codes generated from
the Python table (the C++ holds no second copy)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from fbs.model.skip import BATCH_POLICIES, batch_run, gated_layers, logit_threshold, planned_skip, policy_header, skips

CSRC = Path(__file__).resolve().parents[1] / "src" / "fbs" / "native" / "csrc"


def test_threshold_is_the_logit_of_tau():
    assert logit_threshold(0.5) == 0.0
    assert logit_threshold(0.8) == pytest.approx(math.log(4.0))
    assert logit_threshold(0.0) == -math.inf and logit_threshold(1.0) == math.inf
    assert skips([0.1, -0.1, 2.0], [0.0, 0.0, math.log(4.0)]) == [True, False, True]


@pytest.mark.parametrize("skip,policy,run", [
    ([True, False, False], "gather", [False, True, True]),
    ([True, False, False], "all", [True, True, True]),
    ([True, True, True], "all", [False, False, False]),
    ([True, True, False], "majority", [False, False, False]),   # 2 of 3 skip: more than half
    ([True, True, False, False], "majority", [True, True, True, True]),  # exactly half: run
])
def test_batch_policies(skip, policy, run):
    assert batch_run(skip, policy) == run


def test_never_skip_layers_and_plans():
    assert gated_layers(6, [1, 2, 3, 4], [-2]) == [False, True, True, True, False, False]
    plan = [[False, True], [True, False]]
    assert planned_skip(plan, [0, 1, 5], 0) == [False, True, True]  # the plan's last row repeats


def test_the_native_policy_codes_come_from_the_python_table():
    header = policy_header()
    for name, code in BATCH_POLICIES.items():
        assert f"k{name.capitalize()} = {code}" in header
    skip_h = (CSRC / "skip.h").read_text()
    assert '#include "skip_policy.h"' in skip_h
    assert not (CSRC / "skip_policy.h").exists()  # generated into the build directory only
    code_only = re.sub(r"//.*", "", skip_h)
    assert not re.search(r"policy\s*==\s*\d", code_only)  # decisions use the generated names, not numbers
