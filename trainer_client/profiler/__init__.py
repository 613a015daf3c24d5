"""What ``skrull-profile`` (``trainer_client.profile``) and ``--profile auto`` run: ``sweeps`` (what is measured:
compute, memory, collectives, launch floor), ``document`` (the profile file the measurements are fitted into) and
``measure`` (the timing and memory probes)."""
