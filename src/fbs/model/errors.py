"""The error a damaged, malformed or mismatched FBS checkpoint raises, shared by the checkpoint reader
(:mod:`.checkpoint`) and the adapters it loads (:mod:`.lora`)."""


class CheckpointError(ValueError):
    """An FBS checkpoint is missing, malformed, corrupt or made for another base model."""
