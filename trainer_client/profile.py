"""``python -m trainer_client.profile``: the profiler's command, by the name the docs and scripts run (it lives in
``profiler.command``; ``skrull-profile`` runs it too)."""

from trainer_client.profiler.command import main

if __name__ == "__main__":
    raise SystemExit(main())
