"""A stand-in for a learned classifier, loaded through ``classifier.learned`` in the classifier's
process (tests/test_classify_server.py, tests/test_classify.py): it puts texts about Haskell in
tier ``fp``, and raises for texts about crashes (to show a plug-in's error is the default tier)."""

from __future__ import annotations

from typing import Any


class KeywordModel:
    def __init__(self, limits: Any) -> None:
        self.tiers = list(limits.learned_tiers)

    def classify(self, text: str) -> str | None:
        if "crash" in text:
            raise RuntimeError("the model fell over")
        return "fp" if "haskell" in text.lower() and "fp" in self.tiers else None


def make(limits: Any) -> KeywordModel:
    return KeywordModel(limits)


def broken(limits: Any) -> KeywordModel:
    raise RuntimeError("weights not found")


def not_a_classifier(limits: Any) -> str:
    return "nope"
