"""Test helpers: fake model servers (see ``backends``)."""

from tests.support.backends import Backend, BackendFleet, MetricsMode

__all__ = ["Backend", "BackendFleet", "MetricsMode"]
