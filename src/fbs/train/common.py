"""What the training recipes share: reading a recipe's YAML config (:func:`read_yaml_config`, each config's
``from_yaml``), the config from ``--config`` YAML, ``--set`` overrides and flags (:func:`config_from_args`), and the
checks of the optimization fields every small recipe has (:func:`check_recipe_fields`)."""

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


#: Integer fields of every small recipe config (FlexiDepth, Segatron): coerced, since YAML and --set may give strings.
RECIPE_INTS = ("block_size", "eval_blocks", "max_steps", "batch_tokens", "micro_batch_size", "eval_every",
               "save_every", "keep_checkpoints", "log_every", "seed", "threads")
#: Float fields of every small recipe config.
RECIPE_FLOATS = ("lr", "weight_decay", "grad_clip", "warmup_frac", "min_lr_ratio")


def check_recipe_fields(cfg, error: type[Exception], floats: tuple[str, ...] = ()) -> None:
    """Coerce a recipe config's shared numeric fields (and its own ``floats``) in place ("1e-3" from YAML or --set
    becomes 0.001) and check what every recipe needs: a batch that holds one micro-batch, counts >= 1, lr > 0 and
    warmup_frac in [0, 1). Raises ``error`` naming the field."""
    try:
        for name in RECIPE_FLOATS + floats:
            setattr(cfg, name, float(getattr(cfg, name)))
        for name in RECIPE_INTS:
            setattr(cfg, name, int(getattr(cfg, name)))
        cfg.betas = tuple(float(b) for b in cfg.betas)
    except (TypeError, ValueError) as e:
        raise error(str(e)) from e
    if cfg.batch_tokens < cfg.block_size * cfg.micro_batch_size:
        raise error(f"batch_tokens ({cfg.batch_tokens}) must hold one micro-batch "
                    f"({cfg.micro_batch_size} x {cfg.block_size} tokens)")
    if min(cfg.max_steps, cfg.micro_batch_size, cfg.keep_checkpoints, cfg.log_every) < 1:
        raise error("max_steps, micro_batch_size, keep_checkpoints and log_every must be >= 1")
    if cfg.lr <= 0 or not 0 <= cfg.warmup_frac < 1:
        raise error("lr must be > 0 and warmup_frac in [0, 1)")
