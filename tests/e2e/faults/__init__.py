"""The fault suite (issue 3, points 4, 5 and 7).

A package so that its conftest is imported as ``faults.conftest`` and leaves the name
``conftest`` to ``tests/e2e/conftest.py``, which the e2e modules import from.
"""
