"""Profile documents, and the files and folders that hold them, read into the core's ``Profile``.

A document is validated by the format's model (``skrull_proto.ProfileDocument``
checks its shape), then converted by the core's ``parse_profile`` (which checks
the ranges). Every error is an ``InvalidRequestError`` naming the field
(``compute.alpha_s_per_flop``) and, for a file, the file. The service, the CLI
and the trainer read profiles through ``load_profile``; the service's profile
folder, which it reloads, is ``runtime.profiles.ProfileFolder``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from skrull_proto import ProfileDocument

from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.profile import Profile, parse_profile

__all__ = ["MAX_PROFILE_FILE_BYTES", "load_profile", "load_profile_dir", "profile_from_document", "profile_or_name"]

MAX_PROFILE_FILE_BYTES = 1 << 20  # a profile is a few KiB; a larger file (or registered document) is not one
# pydantic's words for "not an object", said the way a profile's author reads them
_NOT_AN_OBJECT = frozenset({"model_type", "model_attributes_type", "dict_type"})


def profile_from_document(data: Any) -> Profile:
    """The ``Profile`` a JSON document describes; the first bad field is named (with the number of others)."""
    try:
        ProfileDocument.model_validate(data)
    except ValidationError as error:
        first, *others = error.errors(include_url=False)
        path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
        reason = "must be a JSON object" if first["type"] in _NOT_AN_OBJECT else first["msg"]
        more = f" (and {len(others)} more)" if others else ""
        raise InvalidRequestError(f"profile field {path or 'document'}: {reason}{more}",
                                  field=f"profile.{path}" if path else "profile") from None
    return parse_profile(data)


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; errors name the file."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_PROFILE_FILE_BYTES:
            raise InvalidRequestError(f"profile {path} is larger than {MAX_PROFILE_FILE_BYTES} bytes", field="profile")
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidRequestError(f"cannot read profile {path}: {error}", field="profile") from error
    try:
        return profile_from_document(data)
    except InvalidRequestError as error:
        raise InvalidRequestError(f"profile {path}: {error.message}", field="profile") from error


def profile_or_name(choice: str | None) -> str | Profile | None:
    """A profile a user named: the file's profile where ``choice`` is a file, else the name as it is (a shipped
    profile, or one only the scheduler service knows); None stays None (the default)."""
    return load_profile(choice) if choice is not None and Path(choice).is_file() else choice


def load_profile_dir(directory: str | Path) -> dict[str, Profile]:
    """Every ``*.json`` profile in ``directory`` by name; the first bad file (or a duplicate name) is an error
    naming it, so a folder is accepted whole or not at all."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InvalidRequestError(f"profile directory {directory} does not exist or is not a directory",
                                  field="profile_dir")
    profiles: dict[str, Profile] = {}
    origins: dict[str, Path] = {}
    for path in sorted(directory.glob("*.json")):
        profile = load_profile(path)
        if profile.name in profiles:
            raise InvalidRequestError(f"profiles {origins[profile.name]} and {path} are both named {profile.name!r}",
                                      field="profile_dir")
        profiles[profile.name] = profile
        origins[profile.name] = path
    return profiles
