"""Optional bearer-token auth for the endpoints that change state: ``POST /feedback``, ``PUT /jobs/{job_id}/profile``
and ``POST /profiles/reload``.

Off by default: the sidecar listens on localhost, where every caller is the
trainer beside it. A shared Deployment sets ``SKRULL_API_TOKEN`` (from a
Secret), and those endpoints then need ``Authorization: Bearer <token>``; a
missing or wrong token is a 401 with ``WWW-Authenticate: Bearer``. Planning
and the probes never need it: a plan changes nothing, and the kubelet sends no
token. Tokens are compared in constant time.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from scheduler_service.runtime.settings import Settings

__all__ = ["UnauthorizedError", "require_api_token"]

# auto_error=False: the service decides (and answers problem+json); the scheme still appears in the OpenAPI.
_bearer = HTTPBearer(auto_error=False, description="SKRULL_API_TOKEN, where the service sets one.")


class UnauthorizedError(Exception):
    """A state-changing request without the service's bearer token (401, ``problems``)."""

    def __init__(self, message: str, *, token_given: bool) -> None:
        super().__init__(message)
        self.message = message
        self.token_given = token_given


async def require_api_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Let the request through when the service has no token, or the request carries the service's token."""
    settings: Settings = request.app.state.settings
    if settings.api_token is None:
        return
    if credentials is None:
        raise UnauthorizedError("this endpoint needs Authorization: Bearer <token> (the service sets "
                                "SKRULL_API_TOKEN)", token_given=False)
    expected = settings.api_token.get_secret_value().encode()
    if not secrets.compare_digest(credentials.credentials.encode(), expected):
        raise UnauthorizedError("the bearer token is not the service's", token_given=True)
