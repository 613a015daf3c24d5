"""Profiles of this machine: ``command`` (``skrull-profile``, ``python -m trainer_client.profile``) and ``auto``
(``--profile auto``: measured by the run itself, cached per machine and layout) over ``sweeps`` (what is measured:
compute, memory, collectives, launch floor), ``document`` (the profile file the measurements are fitted into) and
``measure`` (the timing and memory probes)."""
