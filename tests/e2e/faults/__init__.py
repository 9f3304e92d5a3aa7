"""The fault suite (issue 3, points 4, 5 and 7): its fixtures in conftest.py, its harness
in harness.py."""
