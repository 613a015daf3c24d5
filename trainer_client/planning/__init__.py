"""Each global batch's plan for the trainer: ``client`` (the scheduler service over HTTP, its retries, deadline and
errors) and ``source`` (rank 0's decision: the service's plan, or the embedded planning core's when the service
fails; profile registration; feedback)."""
