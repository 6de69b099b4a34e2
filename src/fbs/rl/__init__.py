"""Stage-2 RL fine-tuning of the skip gates with PPO (paper §2.5, §3.1.3 "Stage-2", appendices B.2, E.3, E.7).

Library pieces, bottom-up: :mod:`.pool` (the development-only prompt pool and its overlap check),
:mod:`.reward` (R = alpha (c0 - c) / c0 - beta max(0, Delta-l)), :mod:`.credit` (R split into exact
per-decision compute credits and per-token quality rewards; returns and normalised advantages),
:mod:`.rollout` (batched engine episodes replayed for the gates' inputs, typed :class:`~.rollout.Trajectory`),
:mod:`.ppo` (the clipped loss with a KL penalty to the Stage-1 gates, one PPO step), the recipe :mod:`.stage2`,
its reports :mod:`.report`, the acceptance experiment :mod:`.accept` and the credit-horizon probe
:mod:`.horizon`. See docs/rl.md.
"""
