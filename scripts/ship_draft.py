"""Copy a trained Medusa / EAGLE draft into the package as the draft shipped for its base model, and write its record.

    python scripts/ship_draft.py eagle runs/eagle_s25 src/fbs/assets/eagle-smollm2-135m \
        --data runs/drafts_onpolicy --record results/group_a_drafts_s25/eagle_smollm2.json

Loads the trained artifact (``fbs train medusa`` / ``fbs train eagle``), saves it into ``dst`` (EAGLE's layer in
float16, loaded back as fp32: half the bytes; Medusa's heads as trained) with its training record and a ``shipped``
note, and writes ``--record``: the training summary, the data's ``meta.json`` (prompts, answer budget, provenance)
and the artifact's size. The shortlist (token ids) ships with the weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    from fbs.baselines.eagle import CONFIG_NAME as EAGLE_JSON, EagleLayer
    from fbs.baselines.medusa import CONFIG_NAME as MEDUSA_JSON, MedusaHeads
    from fbs.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("medusa", "eagle"))
    ap.add_argument("src", type=Path, help="the --out-dir of fbs train medusa / eagle")
    ap.add_argument("dst", type=Path, help="e.g. src/fbs/assets/eagle-smollm2-135m")
    ap.add_argument("--data", type=Path, help="the fbs data drafts directory it was trained on (its meta.json is recorded)")
    ap.add_argument("--record", type=Path, required=True, help="JSON record to write")
    args = ap.parse_args(argv)

    cls, name = (EagleLayer, EAGLE_JSON) if args.kind == "eagle" else (MedusaHeads, MEDUSA_JSON)
    if not (args.src / name).is_file():
        print(f"error: {args.src} has no {name}; pass the --out-dir of a finished `fbs train {args.kind}` run",
              file=sys.stderr)
        return 2
    info = json.loads((args.src / name).read_text())
    module = cls.load(args.src)
    meta = {k: v for k, v in info.items() if k not in ("shape", "hidden_size", "num_heads", "base_fingerprint",
                                                        "shortlist")}
    dtype = torch.float16 if args.kind == "eagle" else None
    meta["shipped"] = {"from": str(args.src), "dtype": "float16 (the trained fp32 layer rounded; loaded back as fp32)"
                       if dtype is not None else "float32 (as trained)"}
    tmp = args.dst.with_name(args.dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if dtype is not None:
        module.save(tmp, info["base_fingerprint"], meta, dtype=dtype)
    else:
        module.save(tmp, info["base_fingerprint"], meta)
    cls.load(tmp)  # complete and readable
    if args.dst.exists():
        shutil.rmtree(args.dst)
    tmp.replace(args.dst)
    size = sum(p.stat().st_size for p in args.dst.iterdir())
    record = {"what": f"the {args.kind} draft shipped in {args.dst}", "artifact": str(args.dst), "artifact_bytes": size,
              "shortlist": None if module.shortlist is None else int(module.shortlist.numel()),
              "training": info.get("training"), "train_command": info.get("command"),
              "train_data": info.get("data"), "fbs_checkpoint": info.get("fbs_checkpoint"),
              "regression": info.get("regression"), "provenance": info.get("provenance"),
              "data_meta": json.loads((args.data / "meta.json").read_text()) if args.data else None,
              "ship_provenance": provenance()}
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"shipped {args.src} -> {args.dst} ({size / 1e6:.1f} MB); record {args.record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
