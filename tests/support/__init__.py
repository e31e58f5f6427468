"""Test helpers: fake model servers (see ``backends``)."""

from tests.support.backends import Backend, BackendFleet, MetricsMode, VllmPage, vllm_text

__all__ = ["Backend", "BackendFleet", "MetricsMode", "VllmPage", "vllm_text"]
