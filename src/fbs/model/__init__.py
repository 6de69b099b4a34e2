"""The FBS model: a pretrained decoder (:mod:`.hf_adapter`) with the preview window (:mod:`.preview`), chunk
head (:mod:`.chunk`) and skip gates (:mod:`.gate`), one layer step (:mod:`.layer`) and the parallel forward
(:mod:`.causal_lm`). :mod:`.config` holds the configuration, :mod:`.bases` the bundled base models,
:mod:`.loading` checkpoints and :mod:`.lora` the adapters a checkpoint may carry."""
