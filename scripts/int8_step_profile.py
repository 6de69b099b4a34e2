"""Where an eager int8 decode step's time goes: per-op self CPU time per decoded token (torch profiler), as the
difference of a 33-token and a 1-token generate after a 512-token prompt (so the prefill cancels out).

    .venv/bin/python scripts/int8_step_profile.py        # ~1 min; run it alone on the machine
"""
import torch
torch.set_num_threads(2)
from fbs.model.loading import load_fbs
from fbs import engine
m = load_fbs().eval()
ids = torch.randint(100, 20000, (1, 512))
def prof(n):
    kw = dict(max_new_tokens=n, ignore_eos=True, weights="int8", force_compute=True)
    engine.generate(m, ids, **kw)
    with torch.profiler.profile() as p:
        engine.generate(m, ids, **kw)
    return {e.key: (e.self_cpu_time_total, e.count) for e in p.key_averages()}
a, b = prof(33), prof(1)
rows = sorted(((a[k][0] - b.get(k, (0, 0))[0]) / 32 / 1000, k, (a[k][1] - b.get(k, (0, 0))[1]) / 32) for k in a)
tot = sum(r[0] for r in rows)
print(f"decode self CPU per token: {tot:.2f} ms")
for ms, k, c in sorted(rows, reverse=True)[:12]:
    print(f"{ms:7.3f} ms  {c:7.1f} calls  {k}")
