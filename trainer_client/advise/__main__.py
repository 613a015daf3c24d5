"""``python -m trainer_client.advise``."""

from trainer_client.advise.command import main

raise SystemExit(main())
