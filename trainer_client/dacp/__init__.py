"""DACP on a CP rank, what a training loop of your own reuses: ``zigzag`` (which tokens a CP rank owns),
``packing`` (a CP rank's row of a micro-batch and its attention metadata), ``attention`` (DACP attention: local
sequences whole, sharded ones by their collective's scheme: K/V all-gathered over their block, Ulysses all-to-all
over heads, or both, 2D), ``kernels`` (the causal varlen kernel each rank runs: flash-attn, torch's varlen attention
or SDPA), ``prefetch`` (micro-batches packed and copied to the device ahead of the step)."""
