"""``python -m scheduler_service``: see ``scheduler_service.cli``."""

import sys

from scheduler_service.cli import main

sys.exit(main())
