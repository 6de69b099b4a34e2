"""Adaptive-depth baselines on the FBS engine and backbone, so their timings compare with FBS's.

* :mod:`fbs.baselines.ffn_skip` — FFN-SkipLLM (Jaiswal et al. 2024): training-free; per token, FFN blocks
  are skipped after the input and output of a computed block become nearly identical (cosine saturation).
  Attention always runs.
* :mod:`fbs.baselines.flexidepth` — a FlexiDepth-style router (Luo et al. 2025): per layer a router decides per
  token whether to skip the layer, a light adapter processes skipped tokens, K/V are still computed.
  Trained by ``fbs train flexidepth`` (:mod:`fbs.train.flexidepth`, imported by the CLI only).

* :mod:`fbs.baselines.segatron` — a Segatron-style model (Bai et al. 2021; Group D, next to CH): paragraph,
  sentence and token-in-sentence embeddings, found causally in the token stream, added to the input of the base
  decoder (plus LoRA adapters). It skips nothing; it runs as an HF causal LM. Trained by ``fbs train segatron``.

FFN-SkipLLM and FlexiDepth run on :func:`fbs.baselines.host.host_model` (the engine's model with no FBS module) through two hooks
of the core: the engine's ``skip_policy`` (``prefill_mix`` / ``decide`` / ``mix`` / ``bypass`` / ``observe``)
and the parallel forward's ``mixer`` (``route`` / ``observe``), each layer being the one
:func:`fbs.model.layer.layer_step`. Apart from the training module, this package imports only the core and the
engine (the draft sources it registers).

The draft sources of lossless speculative decoding that load trained artifacts register here (importing this
package registers them with :func:`fbs.engine.drafts.register_draft`, which the engine cannot do without importing
a layer above it): ``kangaroo`` (:mod:`fbs.baselines.kangaroo`), ``specdec`` (a distilled draft model,
:mod:`fbs.baselines.specdec`), ``medusa`` (:mod:`fbs.baselines.medusa`) and ``eagle`` (:mod:`fbs.baselines.eagle`),
each with ``draft_options={"path": DIR}``; Medusa heads and the EAGLE layer shipped for a base model
(``assets/medusa-<base>``, ``assets/eagle-<base>``) are used when no path is given
(:func:`fbs.baselines.medusa.shipped_draft`).
"""

from .ffn_skip import FFNSkipLLM, ffn_skip_model
from .flexidepth import FlexiDepth, FlexiDepthConfig, FlexiDepthPolicy, skip_loss
from .host import host_model
from .segatron import Segatron, SegatronConfig
from . import eagle, medusa, specdec
from .medusa import shipped_draft
from ..engine.drafts import register_draft


def _kangaroo_factory(session, adapter=None, path=None, check_base: bool = True):
    """``kangaroo`` with an adapter object, a saved adapter (``path``) or the call's ``draft_adapter``."""
    from ..engine.speculative import KangarooDraft
    from .kangaroo import KangarooAdapter

    if adapter is None and path is not None:
        adapter = KangarooAdapter.load(path, session.dec.m, check_base)
    adapter = adapter if adapter is not None else session.dec.opts.draft_adapter
    if adapter is None:
        raise ValueError("draft 'kangaroo' needs an adapter: draft_options={'path': DIR}; train one with "
                         "`fbs train kangaroo --out-dir DIR`")
    return KangarooDraft(session, adapter)


register_draft("kangaroo", _kangaroo_factory)
register_draft("specdec", specdec.draft_factory)
register_draft("medusa", medusa.draft_factory)
register_draft("eagle", eagle.draft_factory)

__all__ = ["FFNSkipLLM", "FlexiDepth", "FlexiDepthConfig", "FlexiDepthPolicy", "Segatron", "SegatronConfig",
           "ffn_skip_model", "host_model", "shipped_draft", "skip_loss"]
