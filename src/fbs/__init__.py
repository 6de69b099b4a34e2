"""fbs: the Fovea-Block-Skip Transformer over pretrained decoders.

    from fbs import FBSConfig, FBSForCausalLM
    model = FBSForCausalLM.from_base("smollm2-135m", config=FBSConfig(tau=0.7))
    out = model(input_ids)                       # FBSOutput: logits, preview logits, BIOS logits, gates ...
    res = model.generate(input_ids, max_new_tokens=64)   # tokens + per-step trace + timings
"""

from .model.bases import BaseModelError
from .model.causal_lm import CheckpointError, FBSForCausalLM, FBSOutput
from .model.config import ConfigError, FBSConfig
from .model.hf_adapter import SUPPORTED_MODEL_TYPES, UnsupportedArchitectureError

__all__ = [
    "FBSConfig", "FBSForCausalLM", "FBSOutput", "ConfigError", "CheckpointError", "BaseModelError",
    "UnsupportedArchitectureError", "SUPPORTED_MODEL_TYPES",
]
__version__ = "0.1.0"
