"""Skrull's scheduling service: the planning core (``scheduler_service.core``), the CLI and the web app.

Importing this package pulls in nothing heavy; the web layer is only imported by ``serve``.
"""
