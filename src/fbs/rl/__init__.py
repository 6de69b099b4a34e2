"""Stage-2 RL fine-tuning of the skip gates with PPO (paper §2.5, §3.1.3 "Stage-2", appendices B.2, E.7).

Library pieces, bottom-up: :mod:`.pool` (the development-only prompt pool and its overlap check),
:mod:`.reward` (R = alpha (c0 - c) / c0 - beta max(0, Delta-l)), :mod:`.rollout` (episodes from the
decoding engine, typed :class:`~.rollout.Trajectory`), :mod:`.ppo` (the clipped loss and one PPO step),
and the recipe :mod:`.stage2`. See docs/rl.md.
"""
