"""The layout advisor's command (``skrull-advise``, ``python -m trainer_client.advise``): ``command`` over
``inputs`` (a data set's lengths as this trainer encodes them, a checkpoint's shape, a profile file)."""
