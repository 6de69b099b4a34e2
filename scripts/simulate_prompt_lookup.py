"""Simulate prompt lookup's rounds on the verifier over full depth's own greedy outputs, for choosing its settings.

Greedy verification keeps the longest prefix of a proposal that equals full depth's next tokens, plus one token:
given full depth's output, a round's outcome follows from the proposal alone. So the rounds (target passes) and the
verified tokens of any prompt-lookup setting follow without running the model again; the simulation drives the
library's own :class:`fbs.engine.drafts.PromptLookupDraft` (its matching and its adaptive length) and gives the
engine's round counts exactly. Full depth's outputs are computed once (or read with ``--outputs``).

    python scripts/simulate_prompt_lookup.py --checkpoint stage1 --prompt-set code --num-prompts 64 \\
        --settings '[{"max_ngram": 3, "draft_tokens": 4}, {"max_ngram": 6, "draft_tokens": 12}]' --out sim.json

Prints a table (rounds, tokens a round, verified draft tokens, and the speed-up the cost model of a round predicts:
``1 + round_overhead + verify_token_cost * drafted`` decode steps a round, against one step a token) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace


def full_depth_outputs(model_name: str, checkpoint: str | None, prompt_set: str, num_prompts: int, prompt_len: int,
                       new_tokens: int, weights: str) -> list[tuple[list[int], list[int]]]:
    import torch

    from fbs.bench.prompt_sets import build_prompt_set
    from fbs.model.loading import load_fbs

    model = load_fbs(model_name, checkpoint=checkpoint).eval()
    prompts = build_prompt_set(prompt_set, model.tokenizer, num_prompts, prompt_len).prompts
    out = []
    for p in prompts:
        res = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, weights=weights, do_sample=False,
                             ignore_eos=True, force_compute=True)
        out.append(([int(t) for t in p], [int(t) for t in res.new_tokens[0]]))
    return out


def simulate(pairs, max_ngram: int = 6, min_ngram: int = 1, adapt: bool = True, draft_tokens: int = 12) -> dict:
    """Rounds and drafted tokens of greedy verification with prompt lookup over (prompt, full depth's output)
    pairs: the first output token comes from the prompt's pass; each round proposes (the library's draft), keeps
    the proposal's prefix equal to the output, and commits it plus one token."""
    from fbs.engine.drafts import PromptLookupDraft

    rounds = drafted = kept_drafts = tokens = 0
    for prompt, output in pairs:
        dec = SimpleNamespace(prompts=[prompt], out=[output[:1]])
        draft = PromptLookupDraft(SimpleNamespace(dec=dec), max_ngram=max_ngram, min_ngram=min_ngram, adapt=adapt)
        n = 1
        while n < len(output):
            budget = min(draft_tokens, len(output) - n - 1)
            proposal = draft.propose([0], {0: budget}).get(0)
            x = list(proposal.tokens) if proposal is not None else []
            a = 0
            while a < len(x) and x[a] == output[n + a]:
                a += 1
            draft.commit([0], [len(prompt) + n - 1], [a + 1], None)
            rounds, drafted, kept_drafts = rounds + 1, drafted + len(x), kept_drafts + a
            n += a + 1
            dec.out[0] = output[:n]
        tokens += len(output) - 1
    return {"rounds": rounds, "tokens": tokens, "drafted": drafted, "kept": kept_drafts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--checkpoint", default="stage1", help="FBS checkpoint (\"\": the base alone)")
    p.add_argument("--prompt-set", default="code")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--weights", default="q4")
    p.add_argument("--outputs", help="JSON of [[prompt, output], ...] to read instead of generating (and to write "
                                     "if it does not exist)")
    p.add_argument("--settings", default='[{"max_ngram": 3, "draft_tokens": 4}, {"max_ngram": 6, "draft_tokens": 12}]',
                   help="JSON list of settings: max_ngram, min_ngram, adapt, draft_tokens")
    p.add_argument("--round-overhead", type=float, default=0.10, help="a round's cost beyond its pass, in steps")
    p.add_argument("--verify-token-cost", type=float, default=0.14,
                   help="a verified draft token's cost, in steps (BENCHMARKS §5: T = 8 positions cost 1.96 steps)")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    try:
        settings = json.loads(args.settings)
        if not isinstance(settings, list) or not all(isinstance(s, dict) for s in settings):
            raise ValueError("a JSON list of objects")
    except ValueError as e:
        print(f"--settings: {e}; e.g. '[{{\"max_ngram\": 6, \"draft_tokens\": 12}}]'", file=sys.stderr)
        return 2
    pairs = None
    if args.outputs:
        try:
            with open(args.outputs) as f:
                pairs = json.load(f)
        except FileNotFoundError:
            pass
    if pairs is None:
        pairs = full_depth_outputs(args.model, args.checkpoint or None, args.prompt_set, args.num_prompts,
                                   args.prompt_len, args.new_tokens, args.weights)
        if args.outputs:
            with open(args.outputs, "w") as f:
                json.dump(pairs, f)
    rows = []
    print(f"{len(pairs)} {args.prompt_set} prompts | setting | rounds | tokens/round | drafted | kept | predicted speed-up")
    for s in settings:
        r = simulate(pairs, **s)
        cost = r["rounds"] * (1.0 + args.round_overhead) + args.verify_token_cost * r["drafted"]
        r.update(setting=s, tokens_per_round=r["tokens"] / r["rounds"], predicted_speedup=r["tokens"] / cost)
        rows.append(r)
        print(f"{json.dumps(s)} | {r['rounds']} | {r['tokens_per_round']:.3f} | {r['drafted']} | {r['kept']} | "
              f"{r['predicted_speedup']:.3f}x")
    if args.out:
        from fbs.provenance import provenance

        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": rows, "provenance": provenance()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
