"""The HTTP routes, one module per resource: thin wrappers over the runtime's ``PlanningService``.

A route parses (FastAPI, or the runtime's ``parsing`` for the bodies it
parses itself), calls one function and answers; errors are raised, never
formatted here (``web.problems`` maps them to HTTP).
"""

from scheduler_service.web.routes import (
    advise,
    feedback,
    jobs,
    metrics,
    models,
    plans,
    probes,
    profiles,
    samplers,
    viewer,
)

__all__ = ["ROUTERS"]

# In the order the OpenAPI document lists them.
ROUTERS = tuple(module.router for module in (plans, advise, models, profiles, feedback, jobs, probes, metrics,
                                             viewer, samplers))
