"""What the training recipes share: a recipe's config from ``--config`` YAML, ``--set`` overrides and flags."""

from __future__ import annotations

import argparse
import sys


def config_from_args(args: argparse.Namespace, config_cls, error_cls, flags: tuple[str, ...]):
    """Load ``config_cls`` from ``--config`` YAML, ``--set`` overrides and the named shortcut flags.
    Returns the config, or an exit code (2 on a bad config, 0 after ``--print-config``)."""
    overrides = list(args.set or [])
    overrides += [f"{flag}={getattr(args, flag)}" for flag in flags if getattr(args, flag) is not None]
    if args.no_progress:
        overrides.append("progress=false")
    try:
        cfg = config_cls.from_yaml(args.config, overrides)
    except (error_cls, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_json())
        return 0
    return cfg
