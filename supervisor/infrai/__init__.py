"""Infrai: the managed clock-and-queue layer (REST client and its surfaces)."""
