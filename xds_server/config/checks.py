"""Rules that span config sections (each model validates only itself): unique names and
addresses, one socket per listener, endpoint IPs that name one host, endpoint host names that
are DNS names (at most `discovery.dns.max_names` of them, their metrics pages on the same
name), pool references (fallbacks, classes, versions, tiers) that exist and do not loop,
telemetry sources that can feed what a pool needs, node-cluster assignments closed under
the traffic a pool sends on. Every rule returns (key path, reason) pairs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from xds_server.config.addresses import (
    HostPort,
    hostname_problem,
    is_ip,
    parse_host_port,
    same_socket,
    unroutable_reason,
)
from xds_server.config.pools import EndpointConfig, PoolConfig, PromptClassConfig
from xds_server.config.schema import ANY, Config

Problems = list[tuple[str, str]]


def config_problems(config: Config) -> Problems:
    """Every cross-section problem of `config`; empty when it is usable."""
    problems = _name_checks(config) + _fallback_checks(config) + _source_checks(config)
    problems += _rollout_source_checks(config) + _listener_checks(config)
    problems += _shared_port_checks(config) + _dns_name_checks(config)
    names = {pool.name for pool in config.pools}
    for p_index, pool in enumerate(config.pools):
        problems += _endpoint_checks(p_index, pool) + _class_checks(p_index, pool, names)
    problems += _request_class_checks(config)
    return problems + _node_checks(config)


def _duplicates(values: list[str]) -> list[tuple[int, int]]:
    """(index, first index) pairs for every repeated value."""
    seen: dict[str, int] = {}
    found = []
    for index, value in enumerate(values):
        if value in seen:
            found.append((index, seen[value]))
        else:
            seen[value] = index
    return found


def _endpoint_paths(p_index: int, pool: PoolConfig) -> list[tuple[str, EndpointConfig]]:
    if pool.versions is None:
        return [(f"pools[{p_index}].endpoints[{i}]", ep) for i, ep in enumerate(pool.endpoints)]
    return [(f"pools[{p_index}].versions.{version}.endpoints[{i}]", ep)
            for version in ("stable", "canary")
            for i, ep in enumerate(pool.versions[version].endpoints)]  # type: ignore[index]


def _endpoint_checks(p_index: int, pool: PoolConfig) -> Problems:
    problems = []
    seen: dict[str, str] = {}
    for path, endpoint in _endpoint_paths(p_index, pool):
        address = str(endpoint.host_port)
        key = address.lower()
        if key in seen:
            problems.append((f"{path}.address",
                             f"duplicate endpoint address {address!r} (also {seen[key]})"))
        seen.setdefault(key, path)
        host = endpoint.host_port.host
        if not is_ip(host):
            problem = hostname_problem(host)
            if problem is not None:
                problems.append((f"{path}.address", f"expected an IP address or a DNS host "
                                                    f"name, got {host[:64]!r}: {problem}"))
            else:
                problems += _named_url_checks(path, endpoint)
        unroutable = unroutable_reason(endpoint.host_port.host, allow_loopback=True)
        if unroutable is not None:
            problems.append((f"{path}.address", f"{address!r}: {unroutable}"))
    return problems


def endpoint_name(host: str) -> str | None:
    """The DNS name an endpoint host is resolved by (lower case, no final dot), or None for
    an IP."""
    return None if is_ip(host) else host.rstrip(".").lower()


def _named_url_checks(path: str, endpoint: EndpointConfig) -> Problems:
    """A named endpoint's metrics page is read at each address the name resolves to, so its
    `metrics_url` (when given) must name the same host: one page for several addresses would
    give each of them the same reading."""
    name = endpoint_name(endpoint.host_port.host)
    url = endpoint.metrics_url
    if url is None or name is None:
        return []
    host = (urlsplit(url).hostname or "").rstrip(".").lower()
    if host == name:
        return []
    return [(f"{path}.metrics_url", f"an endpoint addressed by DNS name ({name!r}) is scraped "
                                    f"at each address the name resolves to: its metrics_url "
                                    f"must name the same host, got {host[:64]!r}")]


def _dns_name_checks(config: Config) -> Problems:
    """At most `discovery.dns.max_names` distinct endpoint host names in the whole config."""
    names = {name for p_index, pool in enumerate(config.pools)
             for _, endpoint in _endpoint_paths(p_index, pool)
             if (name := endpoint_name(endpoint.host_port.host)) is not None}
    limit = config.discovery.dns.max_names
    if len(names) <= limit:
        return []
    return [("discovery.dns.max_names", f"the endpoints name {len(names)} distinct DNS hosts; "
                                        f"at most {limit} are resolved")]


def _class_checks(p_index: int, pool: PoolConfig, names: set[str]) -> Problems:
    problems = []
    classes = [(f"pools[{p_index}].prompt_classes[{i}]", c) for i, c in enumerate(pool.prompt_classes)]
    if isinstance(pool.long_context, PromptClassConfig):
        classes.append((f"pools[{p_index}].long_context", pool.long_context))
    elif pool.auto_classes and (pool.versions is not None or pool.prompt_classes):
        problems.append((f"pools[{p_index}].long_context", "`auto` cannot be combined with "
                         "`versions` or `prompt_classes` (yet)"))
    for index, (path, cls) in enumerate(classes):
        if cls.pool not in names or cls.pool == pool.name:
            problems.append((f"{path}.pool", f"expected another pool's name, got {cls.pool!r}"))
        for other_path, other in classes[:index]:
            if cls.min_prompt_bytes < other.upper and other.min_prompt_bytes < cls.upper:
                problems.append((path, f"size range overlaps {other_path}"))
    return problems


def _fallback_checks(config: Config) -> Problems:
    problems = []
    by_name = {pool.name: pool for pool in config.pools}
    for index, pool in enumerate(config.pools):
        if pool.fallback is None:
            continue
        if pool.fallback not in by_name or pool.fallback == pool.name:
            problems.append((f"pools[{index}].fallback",
                             f"expected another pool's name, got {pool.fallback!r}"))
            continue
        chain, current = [pool.name], by_name[pool.fallback]
        while current.fallback is not None and current.fallback in by_name:
            chain.append(current.name)
            if current.fallback in chain:
                problems.append((f"pools[{index}].fallback", "fallback cycle: "
                                 + " -> ".join([*chain, current.fallback])))
                break
            current = by_name[current.fallback]
    return problems


def _name_checks(config: Config) -> Problems:
    problems = []
    for index, first in _duplicates([p.name for p in config.pools]):
        problems.append((f"pools[{index}].name",
                         f"duplicate pool name {config.pools[index].name!r} (also pools[{first}])"))
    class_targets = {c.pool for p in config.pools for c in p.size_classes()}
    class_targets |= {c.pool for p in config.pools for c in p.request_classes}
    class_targets |= {t for p in config.pools if p.intent_tiers for t in p.intent_tiers.values()}
    class_targets |= {t for p in config.pools if p.model_versions
                      for t in p.model_versions.pools.values()}
    models = [p.model if p.name not in class_targets else f"\0{p.name}" for p in config.pools]
    for index, first in _duplicates(models):
        problems.append((f"pools[{index}].model",
                         f"model {config.pools[index].model!r} is already served by pools[{first}]"))
    derived = {n: p.name for p in config.pools for n in (p.canary_cluster, p.fallback_cluster)}
    for index, pool in enumerate(config.pools):
        if pool.name in derived:
            problems.append((f"pools[{index}].name", f"{pool.name!r} clashes with a cluster "
                             f"trimtab derives for pool {derived[pool.name]!r}"))
    return problems


def _source_checks(config: Config) -> Problems:
    problems = []
    for p_index, pool in enumerate(config.pools):
        source = pool.source(config)
        if source == "file" and config.telemetry.file is None:
            problems.append((f"pools[{p_index}]", "telemetry source `file` needs telemetry.file"))
        if source != "static":
            continue
        for path, endpoint in _endpoint_paths(p_index, pool):
            if endpoint.signals is None:
                problems.append((f"{path}.signals", "telemetry source `static` needs signals"))
    return problems


def _rollout_source_checks(config: Config) -> Problems:
    """A canary's SLO gates read SLO counters (latency histograms, request and error
    counters), and only the scrape source parses them from the metrics pages: with any other
    source a rollout would never see a request and so never step."""
    problems = []
    for p_index, pool in enumerate(config.pools):
        source = pool.source(config)
        if pool.versions is None or source == "scrape":
            continue
        origin = "" if pool.telemetry_source is not None else " (from telemetry.source)"
        problems.append((f"pools[{p_index}].telemetry_source",
                         f"a canary rollout (`versions`) needs telemetry source `scrape`: its "
                         f"SLO gates read latency histograms and request counters from the "
                         f"endpoints' metrics pages; this pool reads {source!r}{origin}"))
    return problems


def _listener_checks(config: Config) -> Problems:
    host = config.listener.host_port.host
    if is_ip(host):
        return []
    return [("listener.address", f"expected an IP address (Envoy binds a listener to a socket "
                                 f"address, not a hostname), got {host!r}")]


def trimtab_listeners(config: Config) -> list[tuple[str, HostPort]]:
    """Every socket `trimtab serve` listens on, by its config key: xDS, admin, KEDA (when
    set) and the embedded classifier's (when a pool has intent tiers)."""
    listeners = [("xds.address", config.xds.host_port), ("admin.address", config.admin.host_port)]
    if config.keda.address is not None:
        listeners.append(("keda.address", parse_host_port(config.keda.address)))
    classifier = config.classifier
    if classifier is not None and classifier.embedded and any(p.intent_tiers
                                                              for p in config.pools):
        listeners.append(("classifier.address", parse_host_port(classifier.address)))
        if classifier.metrics_address is not None:
            listeners.append(("classifier.metrics_address",
                              parse_host_port(classifier.metrics_address)))
    return listeners


def _shared_port_checks(config: Config) -> Problems:
    """Two of trimtab's listeners on one socket: serve could bind only the first."""
    listeners = trimtab_listeners(config)
    return [(key, f"{where} and {other_key} ({other}) both listen on port {where.port}; "
                  f"give each listener its own port")
            for index, (key, where) in enumerate(listeners)
            for other_key, other in listeners[:index] if same_socket(where, other)]


def _request_class_checks(config: Config) -> Problems:
    names = {pool.name for pool in config.pools}
    return [(f"pools[{p}].request_classes[{i}].pool", f"expected another pool's name, got "
             f"{cls.pool!r}")
            for p, pool in enumerate(config.pools) for i, cls in enumerate(pool.request_classes)
            if cls.pool not in names or cls.pool == pool.name] + _version_checks(config, names)


def _version_checks(config: Config, names: set[str]) -> Problems:
    return [(f"pools[{p}].model_versions.pools.{label}", f"expected another pool's name, "
             f"got {target!r}")
            for p, pool in enumerate(config.pools) if pool.model_versions is not None
            for label, target in pool.model_versions.pools.items()
            if target not in names or target == pool.name] + _tier_checks(config, names)


def _tier_checks(config: Config, names: set[str]) -> Problems:
    problems = []
    tiers = ({rule.tier for rule in config.classifier.rules} | set(config.classifier.learned_tiers)
             if config.classifier else set())
    for p, pool in enumerate(config.pools):
        for tier, target in (pool.intent_tiers or {}).items():
            path = f"pools[{p}].intent_tiers.{tier}"
            if config.classifier is None:
                problems.append((path, "intent tiers need a top-level `classifier`"))
            elif tier not in tiers:
                problems.append((path, f"no classifier rule puts requests in tier {tier!r} "
                                       f"(nor classifier.learned_tiers)"))
            if target not in names or target == pool.name:
                problems.append((path, f"expected another pool's name, got {target!r}"))
    return problems


def _node_checks(config: Config) -> Problems:
    if config.nodes is None:
        return []
    problems = node_pool_problems(config.nodes.clusters, config)
    tls = config.xds.tls
    if config.nodes.require_san_match and (tls is None or not tls.require_client_cert):
        problems.append(("nodes.require_san_match",
                         "needs mTLS: xds.tls with client_ca_file and require_client_cert: true"))
    return problems


def node_pool_problems(clusters: Mapping[str, Sequence[str]], config: Config) -> Problems:
    """Config cross-checks for `nodes.clusters`: unknown pools, and pool sets that are not
    closed under fallback and prompt-size-class references (a node would get routes to
    clusters it is not given)."""
    names = {pool.name for pool in config.pools}
    problems = []
    folded: dict[str, str] = {}
    for cluster in clusters:  # a DNS SAN names a cluster case-insensitively
        other = folded.setdefault(cluster.lower(), cluster)
        if other != cluster:
            problems.append((f"nodes.clusters.{cluster}",
                             f"differs from node cluster {other!r} only in case: one DNS SAN "
                             f"would prove both"))
    for cluster, pools in clusters.items():
        path = f"nodes.clusters.{cluster}"
        for index, name in enumerate(pools):
            if name != ANY and name not in names:
                problems.append((f"{path}[{index}]", f"unknown pool {name!r}"))
        assigned = set(pools) & names
        if ANY in pools:
            continue
        for name in sorted(assigned):
            for dep in sorted(config.pool(name).dependencies() - assigned):
                problems.append((path, f"pool {name!r} sends traffic to pool {dep!r} "
                                       f"(fallback or size class); assign {dep!r} too"))
    return problems
