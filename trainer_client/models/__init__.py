"""The model a rank trains: ``model`` (a transformers causal LM with DACP attention registered), ``lora`` (the
adapters), ``loss`` (a micro-batch's chunked loss, forward and backward) and ``loading`` (the trained module on every
rank, laid out, without a full copy per rank)."""
