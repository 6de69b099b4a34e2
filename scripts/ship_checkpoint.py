"""Copy a Stage-1/Stage-2 export into the package as the shipped FBS weights, with a chosen default tau.

    python scripts/ship_checkpoint.py runs/stage1_smollm2/final src/fbs/assets/fbs-smollm2-135m-stage1 --tau 0.8

Copies the FBS weights, the config (tau replaced, validated through FBSConfig) and the backbone delta
files (LoRA adapters / trained backbone tensors); training metadata is not shipped. Then loads the result
with ``FBSForCausalLM.from_pretrained`` to check it is complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SHIPPED = ("fbs_model.safetensors", "adapters.safetensors", "backbone_trainable.safetensors")


def main(argv: list[str] | None = None) -> int:
    from fbs import FBSConfig, FBSForCausalLM
    from fbs.model.checkpoint import CONFIG_NAME, write_manifest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="export directory (runs/.../final)")
    ap.add_argument("dst", type=Path, help="destination, e.g. src/fbs/assets/fbs-smollm2-135m-stage1")
    ap.add_argument("--tau", type=float, required=True, help="default operating point of the shipped weights")
    ap.add_argument("--note", default="", help="provenance recorded in the config's extra.shipped.note")
    args = ap.parse_args(argv)

    cfg_path = args.src / CONFIG_NAME
    if not cfg_path.is_file():
        print(f"error: {args.src} has no {CONFIG_NAME}; pass an export directory (runs/.../final)", file=sys.stderr)
        return 2
    raw = json.loads(cfg_path.read_text())
    raw["tau"] = args.tau
    raw.setdefault("extra", {})["shipped"] = {"from": str(args.src), "note": args.note}
    FBSConfig.from_dict(raw)  # validates
    tmp = args.dst.with_name(args.dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in SHIPPED:
        if (args.src / name).is_file():
            shutil.copyfile(args.src / name, tmp / name)
    (tmp / CONFIG_NAME).write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    write_manifest(tmp)  # size and sha256 of each weights file, verified at every load
    model = FBSForCausalLM.from_pretrained(tmp)
    assert model.config.tau == args.tau
    shutil.rmtree(args.dst, ignore_errors=True)
    tmp.replace(args.dst)
    size = sum(f.stat().st_size for f in args.dst.iterdir())
    print(f"shipped {args.src} -> {args.dst} (tau={args.tau}, {size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
