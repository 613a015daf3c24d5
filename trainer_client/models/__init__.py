"""The model a rank trains: ``model`` (a transformers causal LM with DACP attention registered), ``lora`` (the
adapters), ``loss`` (a micro-batch's chunked loss, forward and backward), ``parallelize`` (activation checkpointing,
compiled blocks, FSDP2 and the gradient all-reduce, applied to that loss module from outside, over the mesh
``distributed`` made) and ``loading`` (the trained module on every rank, laid out, without a full copy per rank)."""
