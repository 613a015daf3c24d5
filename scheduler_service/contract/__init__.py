"""The contract layer: the wire contract (``skrull_proto``) converted to and from the planning core (``wire``),
the layout advisor's request, words, commands and document (``advice``), and profile documents read from JSON,
files and folders (``profiles``).

The one place where the wire's pydantic models meet the core's dataclasses. It imports the core and the contract
only, no FastAPI and no runtime (a test proves it), so the service, the CLI and the trainer all stand on it, and
the trainer needs nothing else of the service's package but the core.

    core/      the planning core: pure (dataclasses, numpy, numba kernels)
    contract/  this layer: wire <-> core, profile documents
    runtime/   the service without HTTP
    web/       FastAPI: app factory, routes, problem+json, middleware, metrics, the plan viewer
"""
