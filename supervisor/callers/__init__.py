"""Callers: how a team's existing scheduler opens runs (Celery beat, a Temporal workflow).

Each module here speaks to the service only over its documented `/v1` API
(docs/api.md) and imports no module of the service's own beyond its vocabulary: a
caller runs in another process, usually on another machine, and ships as an extra
(``pip install 'cleanup-supervisor[temporal]'``, ``[celery]``).
"""
