"""Callers: how a team's existing scheduler opens runs (Celery beat, Temporal)."""
