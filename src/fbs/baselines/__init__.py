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
:func:`fbs.model.layer.layer_step`. Apart from the training module, this package imports only the core.
"""

from .ffn_skip import FFNSkipLLM, ffn_skip_model
from .flexidepth import FlexiDepth, FlexiDepthConfig, FlexiDepthPolicy, skip_loss
from .host import host_model
from .segatron import Segatron, SegatronConfig

__all__ = ["FFNSkipLLM", "FlexiDepth", "FlexiDepthConfig", "FlexiDepthPolicy", "Segatron", "SegatronConfig",
           "ffn_skip_model", "host_model", "skip_loss"]
