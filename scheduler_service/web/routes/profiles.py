"""``POST /profiles/reload``: the profile folder read again."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from skrull_proto import ProfilesReloaded

from scheduler_service.web.auth import require_api_token
from scheduler_service.web.deps import PlannerDep, SettingsDep
from scheduler_service.web.problems import PROBLEM_RESPONSES, UNAUTHORIZED_RESPONSE

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/profiles/reload",
    operation_id="reloadProfiles",
    dependencies=[Depends(require_api_token)],
    response_model=ProfilesReloaded,
    responses={401: UNAUTHORIZED_RESPONSE, 422: PROBLEM_RESPONSES[422]},
    summary="Read the profile folder again",
    description="Reads SKRULL_PROFILE_DIR again, whole or not at all: a bad file is a 422 naming it, and the "
    "profiles loaded before stay in use.",
)
async def reload_profiles(planner: PlannerDep, settings: SettingsDep) -> ProfilesReloaded:
    names = planner.reload_profiles()
    # The folder's name: answers never carry a server's file-system path.
    directory = None if settings.profile_dir is None else settings.profile_dir.name
    return ProfilesReloaded(directory=directory, profiles=names)
