"""Profiles read from files and folders into the core's ``Profile``.

A file is validated by the format's model (``skrull_proto.ProfileDocument``
checks its shape), then converted by the core's ``parse_profile`` (which checks
the ranges). Every error is an ``InvalidRequestError`` naming the field
(``compute.alpha_s_per_flop``) and, for a file, the file. The service, the CLI
and the trainer read profiles through ``load_profile``.

The service's profile folder (``ProfileFolder``) is read at start-up (a bad file
stops the start, naming it), again on ``POST /profiles/reload``, and before a
request uses it when the folder changed since this process last read it: with
several uvicorn workers a reload reaches the one worker that answers it, and the
others follow at their next request. A folder is taken whole or not at all.
The folder's errors name the file within the folder, never the server's path to
it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from skrull_proto import ProfileDocument

from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.profile import Profile, builtin_profiles, parse_profile

__all__ = ["MAX_PROFILE_FILE_BYTES", "ProfileFolder", "load_profile", "load_profile_dir", "profile_from_document"]

logger = logging.getLogger("scheduler_service.runtime.profiles")

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


class ProfileFolder:
    """The profiles of one folder (none when ``directory`` is None), as last read whole."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.profiles: dict[str, Profile] = {}
        self._seen: object = None  # the folder's state at the last (re)load, successful or not

    def reload(self) -> list[str]:
        """Read the folder again (whole or not at all); the names it holds."""
        directory = self.directory
        if directory is None:
            return []
        self._seen = self._state()
        try:
            profiles = load_profile_dir(directory)
        except InvalidRequestError as error:
            # The log keeps the paths; the answer names files within the folder only.
            logger.warning("profile folder refused", extra={"profile_dir": str(directory), "error": error.message})
            raise InvalidRequestError(_without_folder(error.message, directory), field=error.field) from None
        clashes = sorted(set(profiles) & set(builtin_profiles()))
        if clashes:
            raise InvalidRequestError(f"profiles in the profile folder reuse shipped names: "
                                      f"{', '.join(clashes)}; rename them", field="profile_dir")
        self.profiles = profiles
        logger.info("profiles loaded", extra={"profile_dir": str(directory), "profiles": sorted(profiles)})
        return sorted(profiles)

    def refresh(self) -> None:
        """Read the folder again if it changed (files added, removed, renamed or rewritten) since this process last
        read it, so every worker serves what another worker's reload read. The check is a few ``stat`` calls; a
        folder that fails to read is not read again until it changes (the profiles loaded before stay)."""
        if self.directory is None or self._state() == self._seen:
            return
        with contextlib.suppress(InvalidRequestError):  # logged by reload; requests then see the old profiles
            self.reload()

    def _state(self) -> object:
        """What changes when a profile file is added, removed, renamed or rewritten (cheap: no file is read)."""
        directory = self.directory
        if directory is None:
            return None
        try:
            files = sorted((path.name, stat.st_mtime_ns, stat.st_size)
                           for path in Path(directory).glob("*.json") for stat in (path.stat(),))
            return Path(directory).stat().st_mtime_ns, tuple(files)
        except OSError as error:
            return repr(error)


def _without_folder(message: str, directory: Path) -> str:
    """``message`` with the folder's path left out: answers never carry a server's file-system paths."""
    folder = str(directory).rstrip("/")
    return message.replace(folder + "/", "").replace(folder, "the profile folder")
