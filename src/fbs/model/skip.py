"""The skip rule, defined once: gate logit -> skip under tau, the batch policy, never-skip layers, forced plans.

A gated layer is skipped for a token when its gate's probability exceeds tau, i.e. when its logit exceeds
:func:`logit_threshold` (tau); a forced plan (``skip_plan``) decides instead of the gates; never-skip layers
(the config's first / last layers and a call's extra ones) have no gate. In a batch, rows disagree, and the
batch policy decides which rows run a layer (:func:`batch_run`). The engine's Python step and the native
layer (``fbs/native/csrc/skip.h``, whose policy codes are generated from :data:`BATCH_POLICIES`) both apply
this rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Batch policies and their codes (the native layer's codes are generated from this table):
#: ``gather`` runs a layer only for the rows that compute it; ``all`` runs it for every row unless all rows skip;
#: ``majority`` skips it for every row when more than half the rows skip it, else runs it for every row.
BATCH_POLICIES: dict[str, int] = {"gather": 0, "all": 1, "majority": 2}


def logit_threshold(tau: float) -> float:
    """p > tau  <=>  logit > log(tau / (1 - tau)); tau = 0 skips everything a gate sees, tau = 1 nothing."""
    if tau <= 0.0:
        return -math.inf
    if tau >= 1.0:
        return math.inf
    return math.log(tau / (1.0 - tau))


def skips(logits: Sequence[float], thresholds: Sequence[float]) -> list[bool]:
    """Per row, the gate says skip: its logit exceeds its threshold (:func:`logit_threshold` of its tau)."""
    return [v > t for v, t in zip(logits, thresholds)]


def batch_run(skip: Sequence[bool], policy: str) -> list[bool]:
    """Which rows run the layer (or its FFN), from what each row intends, under the batch ``policy``."""
    run = [not s for s in skip]
    if policy == "all" and any(run):
        return [True] * len(run)
    if policy == "majority":
        return [sum(skip) * 2 <= len(skip)] * len(run)
    return run


def gated_layers(num_layers: int, gated: Sequence[int], never_skip: Sequence[int]) -> list[bool]:
    """Per layer, whether its gate decides: it has a gate and is not in ``never_skip`` (negative indices count
    from the last layer)."""
    never = {l % num_layers for l in never_skip}
    return [l in gated and l not in never for l in range(num_layers)]


def planned_skip(plan: list[list[bool]], steps: Sequence[int], layer: int) -> list[bool]:
    """A forced plan's decision for ``layer`` at each row's generated-token index (the plan's last row repeats)."""
    return [plan[min(s, len(plan) - 1)][layer] for s in steps]


def policy_header() -> str:
    """The C++ header of the batch-policy codes (``skip_policy.h``), generated from :data:`BATCH_POLICIES`."""
    names = ", ".join(f"k{name.capitalize()} = {code}" for name, code in BATCH_POLICIES.items())
    return ("// Generated from fbs.model.skip.BATCH_POLICIES when the extension is built; do not edit.\n"
            "#pragma once\n\n#include <cstdint>\n\n"
            f"namespace fbs_skip {{\nenum BatchPolicy : int64_t {{ {names} }};\n}}  // namespace fbs_skip\n")
