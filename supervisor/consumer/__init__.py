"""The consumer: a pool of workers that fetch, decide, attempt and settle (one module
each; :mod:`supervisor.consumer.pool` puts them together)."""

from supervisor.consumer.pool import ConsumerPool

__all__ = ["ConsumerPool"]
