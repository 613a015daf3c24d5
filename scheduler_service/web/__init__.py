"""The service's web layer: FastAPI over the runtime.

``app.create_app`` (the factory uvicorn imports through ``app_factory``),
``deps`` (the app's objects as dependencies), one route module per resource
(``routes``), the problem+json mapping of every error (``problems``), the ASGI
middleware, the Prometheus ``metrics``, the ``server`` that runs uvicorn, and
the plan viewer's static page.
"""
