"""The service's runtime: everything the service does that is not HTTP.

Planning and refitting off the event loop (``service.PlanningService``, the
work itself in ``work``, the process ``pools``), the job store, the profile
folder, the request parsing and cost estimates, the settings and the service's
own errors. No FastAPI or Starlette here (a test proves it): the web layer
above maps these to HTTP, and pool processes import this layer only. What the
runtime reports (metrics) and how it learns that a client left go through the
protocols of ``events``.

    core/      the planning core: pure (dataclasses, numpy, numba kernels)
    contract/  wire <-> core conversion, profile documents (what the trainer shares with the service)
    runtime/   this layer: the service without HTTP
    web/       FastAPI: app factory, routes, problem+json, middleware, metrics, the plan viewer
"""
