"""The planning core stays pure: no web framework, no pydantic, no torch, no storage."""

import subprocess
import sys


def test_planning_core_imports_no_framework() -> None:
    code = (
        "import sys, scheduler_service.core, scheduler_service.core.planner;"
        "heavy = {'fastapi', 'starlette', 'pydantic', 'torch', 'ortools', 'uvicorn', 'httpx', 'redis', 'sqlite3'};"
        "print(sorted(heavy & {name.split('.')[0] for name in sys.modules}))"
    )
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert output.strip() == "[]"
