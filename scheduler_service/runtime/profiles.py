"""The service's profile folder: read at start-up (a bad file stops the start, naming it), again on
``POST /profiles/reload``, and before a request uses it when the folder changed since this process last read it:
with several uvicorn workers a reload reaches the one worker that answers it, and the others follow at their next
request. A folder is taken whole or not at all. The folder's errors name the file within the folder, never the
server's path to it. Reading a file is the contract's (``contract.profiles``).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from scheduler_service.contract.profiles import load_profile_dir
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.profile import Profile, builtin_profiles

__all__ = ["ProfileFolder"]

logger = logging.getLogger("scheduler_service.runtime.profiles")


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
