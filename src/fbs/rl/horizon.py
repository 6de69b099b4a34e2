"""How far does one gate decision's effect on quality reach? The measurement behind the discount gamma.

A decision at token t changes token t's output and, through the K/V it leaves in the cache, the outputs of
later tokens. This flips single decisions of sampled-gate episodes and replays them teacher-forced
(``gate_mode="plan"``, the tokens fixed), recording the change of every later token's divergence from the
full-depth model: mean |delta d_(t+k)| for k = 0..K. The profile over k, relative to k = 0, is the decay the
quality reward-to-go should have::

    python -m fbs.rl.horizon --checkpoint src/fbs/assets/fbs-smollm2-135m-stage1 --pool runs/stage2_smollm2/pool.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .credit import token_divergence
from .rollout import _with_suffix


@torch.no_grad()
def effect_profile(model, prompts: list[list[int]], max_new_tokens: int = 24, flips: int = 16, horizon: int = 8,
                   seed: int = 0) -> list[float]:
    """mean |d'_(t+k) - d_(t+k)| for k = 0..horizon over ``flips`` random single-decision flips per prompt."""
    g = torch.Generator().manual_seed(seed)
    sums, counts = torch.zeros(horizon + 1, dtype=torch.float64), torch.zeros(horizon + 1, dtype=torch.float64)
    for i, prompt in enumerate(prompts):
        res = model.generate([prompt], max_new_tokens=max_new_tokens, gate_sampling=True, seed=seed + i,
                             batch_policy="gather", ignore_eos=True)
        tr = res.trace
        ids, mask, p = _with_suffix([prompt], res.new_tokens, model.preview_ids.device)
        n = tr.valid.shape[1]
        decided = (~torch.isnan(tr.gate_p) & tr.valid.unsqueeze(-1))[0]        # (N, L)
        where = decided[: n - 1].nonzero()
        if len(where) == 0:
            continue
        pick = where[torch.randperm(len(where), generator=g)[:flips]]
        base = torch.zeros(1, ids.shape[1], model.num_layers, dtype=torch.bool)
        base[0, p:p + n] = tr.intended_skip[0] & decided
        plans = base.repeat(len(pick) + 1, 1, 1)
        for r, (t, l) in enumerate(pick.tolist(), start=1):
            plans[r, p + t, l] = ~plans[r, p + t, l]
        rows = ids.repeat(len(pick) + 1, 1)
        fbs = model(rows, mask.repeat(len(pick) + 1, 1), gate_mode="plan", skip_plan=plans, gate_from=p,
                    soft_window=False).logits[:, p:p + n - 1]
        full = model(ids, mask, gate_mode="off", soft_window=False).logits[:, p:p + n - 1]
        d = token_divergence(full.expand_as(fbs), fbs, rows[:, p + 1:p + n], "kl")   # (1 + flips, n - 1)
        for r, (t, _) in enumerate(pick.tolist(), start=1):
            for k in range(horizon + 1):
                if t + k < n - 1:
                    sums[k] += float((d[r, t + k] - d[0, t + k]).abs())
                    counts[k] += 1
    return (sums / counts.clamp_min(1)).tolist()


def main(argv: list[str] | None = None) -> int:
    from .pool import load_pool
    from .stage2 import Stage2Config, build_model, encode_pool

    ap = argparse.ArgumentParser(prog="python -m fbs.rl.horizon", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="Stage-1 export (or a Stage-2 final/)")
    ap.add_argument("--pool", required=True, help="prompt pool JSONL (fbs train stage2 --build-pool)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--flips", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--horizon", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(Stage2Config(init_from=args.checkpoint))
    items = load_pool(args.pool)
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(args.seed)).tolist()
    prompts = [e.prompt_ids for e in encode_pool([items[i] for i in order[:4 * args.prompts]], model.tokenizer,
                                                   args.max_prompt_tokens)][:args.prompts]
    prof = effect_profile(model, prompts, args.max_new_tokens, args.flips, args.horizon, args.seed)
    rel = [x / prof[0] if prof[0] > 0 else float("nan") for x in prof]
    print(json.dumps({"mean_abs_delta_d": prof, "relative_to_own_token": rel, "prompts": len(prompts),
                      "flips_per_prompt": args.flips}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
