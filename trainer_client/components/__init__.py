"""The parts of a run around its steps: ``optim`` (AdamW, the learning-rate schedule, clipping), ``step_metrics``
(what a step measures), ``reporting`` (where rank 0 writes it: the metrics file and the experiment trackers),
``checkpoint`` (DCP save and resume), ``run_identity`` (what a checkpoint must share with the run that resumes it),
``stop`` (SIGINT and SIGTERM: every rank saves at the step boundary and stops), ``model_export`` (a Hugging Face
model folder from the trained model or a checkpoint)."""
