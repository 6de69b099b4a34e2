"""Paper-protocol speed benchmark (appendix B.3-B.5, E.8, F.2): harness, systems, roofline, report, CLI.

    fbs bench                        # every system, prompt 512 -> 128 tokens, batch 1, 20 warm-up + 50 runs
    fbs bench --quick --systems hf-greedy,fbs-full

See docs/bench.md for the protocol, the TFLOPs(rel) definitions and the JSON schema.
"""
