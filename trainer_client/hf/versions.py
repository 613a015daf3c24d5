"""The transformers, accelerate and TRL releases the Trainer integration is tested with, checked at start.

``SkrullTrainer`` replaces steps of transformers' ``Trainer`` (its training step, its evaluation loop, how its data
loader deals batches to the ranks, the accelerator's DDP settings) and ``SkrullSFTTrainer`` one of TRL's
``SFTTrainer`` (its loss, through TRL's fused LM head). Those steps change between releases, and a change there
would not fail loudly: it would train another model. So the installed releases are compared with the ones the tests
ran against (``TESTED``, the ``hf`` and ``trl`` extras of pyproject.toml, pinned in constraints.txt). A TRL outside
its range is refused; transformers or accelerate outside theirs is named in a warning, since the bundled trainer
shares them and may need another release.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Mapping

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["TESTED", "check_versions"]

logger = logging.getLogger("trainer_client.hf")

TESTED = {
    "transformers": SpecifierSet(">=5.23,<5.24"),
    "accelerate": SpecifierSet(">=1.15,<1.16"),
    "trl": SpecifierSet(">=1.16,<1.17"),
}
REFUSED_OUTSIDE = frozenset({"trl"})


def check_versions(packages: tuple[str, ...], installed: Mapping[str, str] | None = None) -> None:
    """Compare ``packages``' installed releases (``installed``: name → version; None reads the environment) with
    ``TESTED``: raise ``ValueError`` for a TRL outside its range, log a warning for transformers or accelerate."""
    for package in packages:
        version = installed[package] if installed is not None else importlib.metadata.version(package)
        if Version(version) in TESTED[package]:
            continue
        message = (f"{package} {version} is outside the range the Skrull Trainer integration is tested with, "
                   f"{package}{TESTED[package]}")
        if package in REFUSED_OUTSIDE:
            raise ValueError(f"{message}: pip install 'skrull[trl]' installs a tested one")
        logger.warning("%s; it may train differently: pip install 'skrull[hf]' installs a tested one", message)
