"""Training corpora, weak BIOS supervision and the BIOS-F1 probe (paper 3.1.2 and appendix D).

Modules: ``sources`` (offline sources and cache), ``dedup`` (exact + MinHash near-duplicates),
``corpus`` (build, label, packed token stream), ``bios`` (weak labels, alignment, noise score,
CE/CTC), ``metrics`` (chunk parsing, BIOS-F1, boundary-F1), ``probe`` (probe-on-hidden-states),
``cli`` (``fbs data ...`` and ``fbs probe``).
"""
