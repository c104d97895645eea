"""What the tests share beside the fixtures of tests/conftest.py: the repository's paths and helper modules."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"  # the small files the tests read
