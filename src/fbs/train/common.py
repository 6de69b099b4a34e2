"""What the training recipes share: reading a recipe's YAML config (:func:`read_yaml_config`, each config's
``from_yaml``) and the config from ``--config`` YAML, ``--set`` overrides and flags (:func:`config_from_args`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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


def read_yaml_config(path: str | Path | None, error: type[Exception], name: str) -> dict:
    """The mapping of config fields in the YAML file ``path`` ({} when None); ``error`` names the file and the
    config ``name`` when the file holds something else."""
    import yaml

    if path is None:
        return {}
    d = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(d, dict):
        raise error(f"{path} must hold a mapping of {name} fields")
    return d
