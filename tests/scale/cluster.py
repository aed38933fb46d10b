"""The throwaway PostgreSQL of the tests that stop or restart the server: see :mod:`tests.pg`."""

from tests.pg import Cluster, throwaway_cluster

__all__ = ["Cluster", "throwaway_cluster"]
