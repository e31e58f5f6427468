"""The docs cover the product: every metric it registers is in docs/metrics.md, every config
key is in docs/configuration.md, and every relative link in README.md and docs/ resolves."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import REGISTRY
from pydantic import BaseModel

import xds_server.app  # noqa: F401  (registers trimtab serve's metrics)
import xds_server.classify  # noqa: F401  (registers trimtab classify's metrics)
from xds_server.admin.metrics import FleetCollector
from xds_server.config.schema import Config
from xds_server.xds.lrs import EnvoyLoad, LoadCollector

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def registered_metrics() -> set[str]:
    """The exposed names of trimtab's metrics (a counter family ``x`` is served as ``x_total``):
    the global registry's, and the fleet's and Envoy load reports' series rendered at scrape
    time."""
    families = [*REGISTRY.collect(), *FleetCollector(dict).collect(),
                *LoadCollector(EnvoyLoad(), lambda: 1.0).collect()]
    return {f.name + ("_total" if f.type == "counter" else "")
            for f in families if f.name.startswith("trimtab_")}


def test_every_registered_metric_is_in_docs_metrics() -> None:
    names = registered_metrics()
    assert {"trimtab_endpoint_weight", "trimtab_xds_nacks_total", "trimtab_leader",
            "trimtab_classifier_decisions_total"} <= names
    page = (DOCS / "metrics.md").read_text()
    documented = set(re.findall(r"`(trimtab_\w+)`", page))
    assert sorted(names - documented) == []


def _models(annotation: object) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def config_keys(model: type[BaseModel], path: str = "",
                seen: set[type[BaseModel]] | None = None) -> Iterator[tuple[str, str]]:
    """(key path, key) for every field of the config schema, nested models included."""
    seen = set() if seen is None else seen
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        key = field.alias or name
        where = f"{path}.{key}" if path else key
        yield where, key
        for sub in _models(field.annotation):
            yield from config_keys(sub, where, seen)


def test_every_config_key_is_in_docs_configuration() -> None:
    keys = dict(config_keys(Config))
    assert {"xds", "pools.endpoints.address", "weights.queueing.window_seconds",
            "coordination.kubernetes.lease_seconds"} <= set(keys)
    page = (DOCS / "configuration.md").read_text()
    missing = [where for where, key in keys.items()
               if not re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", page)]
    assert missing == []


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: link text only, lower case, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    fence, out = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#+ (.+)$", line)):
            out.add(_anchor(m.group(1)))
    return out


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    broken, checked = [], 0
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            checked += 1
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert checked > 50
    assert broken == []


SOURCE_PATH = re.compile(
    r"\b(?:xds_server|trimtab_dev|weight_calculator|tests|examples|deploy)/[\w./-]*\w")


def test_every_source_path_named_in_readme_and_docs_exists() -> None:
    named = {p for page in _pages() for p in SOURCE_PATH.findall(page.read_text())}
    assert "xds_server/xds/protocol.py" in named
    assert sorted(p for p in named if not (ROOT / p).exists()) == []
