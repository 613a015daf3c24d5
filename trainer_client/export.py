"""``python -m trainer_client.export``: the export command, by the name the docs and scripts run (it lives in
``components.export``; ``skrull-export`` runs it too)."""

from trainer_client.components.model_export import main

if __name__ == "__main__":
    raise SystemExit(main())
