"""The `trimtab` command line. Exit status 2 means bad input (config, arguments)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from typing import TYPE_CHECKING, Any

from xds_server import __version__
from xds_server.config.addresses import HostPort
from xds_server.config.load import ConfigError, load_config
from xds_server.control.rollouts.machine import RolloutStateError
from xds_server.listen import CannotListen

if TYPE_CHECKING:
    from xds_server.app import Trimtab
    from xds_server.telemetry.nvml_agent import GpuReader

EXIT_BAD_INPUT = 2


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message[, exc]."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, tz=UTC)
        entry = {"time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                 "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.Formatter.converter = time.gmtime
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trimtab", description=__doc__)
    parser.add_argument("--version", action="version", version=f"trimtab {__version__}")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, summary) in _DELEGATED.items():
        sub.add_parser(name, help=f"{summary} (see `trimtab {name} --help`)", add_help=False)
    for name, target in sorted(_plugins().items()):
        sub.add_parser(name, help=f"development tool {target.partition(':')[0]} "
                                  f"(see `trimtab {name} --help`)", add_help=False)
    serve = sub.add_parser("serve", help="run the control plane in the foreground")
    serve.add_argument("--config", required=True, help="path to the YAML config")
    validate = sub.add_parser("validate", help="check a config; exit 2 naming what is wrong")
    validate.add_argument("--config", required=True, help="path to the YAML config")
    weights = sub.add_parser("weights", help="read telemetry once; show every input and weight")
    weights.add_argument("--config", required=True, help="path to the YAML config")
    weights.add_argument("--json", action="store_true", help="JSON rows instead of a table")
    weights.add_argument("--sample-interval", type=float, default=1.0, metavar="S",
                         help="seconds between the two reads that windowed ITL needs "
                              "(default 1; 0: one read, latency left out)")
    agent = sub.add_parser("agent", help="serve this node's GPUs (NVML) in DCGM metric names")
    agent.add_argument("--listen", default="0.0.0.0:9400", help="host:port (default 0.0.0.0:9400)")
    ro = sub.add_parser("rollout", help="show or steer canary rollouts through the admin API")
    ro.add_argument("action", choices=["status", "pause", "resume", "promote", "abort"])
    ro.add_argument("pool", nargs="?", help="the pool (required except for status; status "
                                            "without one shows every pool with a rollout)")
    ro.add_argument("--json", action="store_true",
                    help="status: the admin API's JSON document instead of a table")
    where = ro.add_mutually_exclusive_group()
    where.add_argument("--config", help="read the admin address from this config")
    where.add_argument("--admin", help="admin base URL (default http://127.0.0.1:19100)")
    return parser


def cmd_validate(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"trimtab: invalid config {args.config}:\n{exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    endpoints = sum(len(pool.all_endpoints()) for pool in config.pools)
    print(f"{args.config}: ok ({len(config.pools)} pools, {endpoints} endpoints)")
    return 0


async def _serve(config_path: str, app_type: type[Trimtab] | None) -> int:
    from xds_server.app import Trimtab

    config = load_config(config_path)
    try:
        app = (app_type or Trimtab)(config, config_path)
    except RolloutStateError as exc:
        print(f"trimtab: refusing to start: rollout state file {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(app.reload()))
    try:
        await app.start()
    except CannotListen as exc:  # the operator's: a port in use, privileged, not this host's
        await app.close()
        print(f"trimtab: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # the environment: a port in use, an unreadable certificate
        await app.close()
        print(f"trimtab: cannot start: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # the operator's input, e.g. a missing or empty admin token
        await app.close()
        print(f"trimtab: cannot start: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    await app.run(stop)
    logging.getLogger("trimtab").info("shut down cleanly")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return serve_app(args.config)


def serve_app(config_path: str, app_type: type[Trimtab] | None = None) -> int:
    """`trimtab serve`: run ``app_type`` (default Trimtab) until SIGTERM/SIGINT."""
    try:
        load_config(config_path)
    except ConfigError as exc:
        print(f"trimtab: invalid config {config_path}:\n{exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return asyncio.run(_serve(config_path, app_type))


def cmd_weights(args: argparse.Namespace) -> int:
    from xds_server.control.explain import explain

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"trimtab: invalid config {args.config}:\n{exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(explain(config, as_json=args.json, sample_interval=max(0.0, args.sample_interval)))
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from xds_server.config.addresses import parse_host_port
    from xds_server.telemetry.nvml_agent import NvmlUnavailable, PynvmlReader

    try:
        where = parse_host_port(args.listen)
    except ValueError as exc:
        print(f"trimtab: --listen: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        reader = PynvmlReader()
    except NvmlUnavailable as exc:
        print(f"trimtab: agent: {exc}", file=sys.stderr)
        return 1
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_agent(reader, where.host, where.port))
    except OSError as exc:
        print(f"trimtab: agent: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    finally:
        reader.close()
    return 0


async def _agent(reader: GpuReader, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT (when run in the main thread) or cancellation."""
    from xds_server.telemetry.nvml_agent import serve_agent

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    with contextlib.suppress(ValueError, RuntimeError):  # only the main thread gets signals
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
    try:
        await serve_agent(reader, host, port, stop)
        logging.getLogger("trimtab.agent").info("agent shut down cleanly")
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


@dataclass(frozen=True)
class AdminTarget:
    base: str            # http://host:port
    token: str | None    # admin.auth's bearer token, when the config sets one


def _admin_target(args: argparse.Namespace) -> AdminTarget:
    """Where the admin API is and its token: from --admin, --config or the default. Raises
    ConfigError for a bad config or an unreadable token (admin.auth.token_file/token_env)."""
    from xds_server.security.admin_auth import load_token

    if args.admin:
        return AdminTarget(args.admin.rstrip("/"), None)
    if not args.config:
        return AdminTarget("http://127.0.0.1:19100", None)
    admin = load_config(args.config).admin
    host = "127.0.0.1" if admin.host_port.host in ("0.0.0.0", "::") else admin.host_port.host
    base = f"http://{HostPort(host, admin.host_port.port)}"  # [v6]:port when IPv6
    try:
        token = load_token(admin.auth.token_file, admin.auth.token_env)
    except ValueError as exc:
        key = "token_file" if admin.auth.token_file is not None else "token_env"
        raise ConfigError([(f"admin.auth.{key}", str(exc))]) from None
    return AdminTarget(base, token)


def _rollout_request(target: AdminTarget, action: str, pool: str | None) -> urllib.request.Request:
    headers = {"authorization": f"Bearer {target.token}"} if target.token else {}
    if action == "status":
        return urllib.request.Request(f"{target.base}/v1/rollouts", headers=headers)
    return urllib.request.Request(f"{target.base}/v1/rollouts/{pool}/{action}", data=b"{}",
                                  method="POST",
                                  headers={**headers, "content-type": "application/json"})


ROLLOUT_HISTORY_ROWS = 10  # `rollout status POOL` shows this many of the latest events


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in (header, *rows)]


def _age(then: Any, now: float) -> str:
    if not isinstance(then, int | float) or then <= 0:
        return "-"
    seconds = max(0, int(now - then))
    return (f"{seconds}s" if seconds < 120 else f"{seconds // 60}m" if seconds < 7200
            else f"{seconds // 3600}h")


def _clock(at: Any) -> str:
    if not isinstance(at, int | float) or at <= 0:
        return "-"
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def render_rollouts(document: dict[str, Any], pool: str | None = None,
                    now: float | None = None) -> str:
    """`trimtab rollout status [POOL]` as a table: a row per pool (only POOL's when given),
    then POOL's latest events, then whether this replica steps rollouts. Raises KeyError
    when POOL has no rollout in ``document``."""
    now = time.time() if now is None else now
    rollouts: dict[str, Any] = document.get("rollouts") or {}
    if pool is not None:
        rollouts = {pool: rollouts[pool]}
    rows = [[name, str(r.get("phase", "-")), f"{r.get('percent', 0):g}%", str(r.get("step", "-")),
             _age(r.get("step_started_at"), now), str(r.get("reason") or "-")]
            for name, r in sorted(rollouts.items())]
    lines = (_table(("pool", "phase", "canary", "step", "step age", "reason"), rows) if rows
             else ["no pool has a rollout (a pool needs `versions`)"])
    if pool is not None:
        events = (rollouts[pool].get("history") or [])[-ROLLOUT_HISTORY_ROWS:]
        lines += ["", f"latest events of {pool} (oldest first):"]
        lines += _table(("at", "event", "canary", "reason"),
                        [[_clock(e.get("at")), str(e.get("kind", "-")),
                          f"{e.get('percent', 0):g}%", str(e.get("reason") or "-")]
                         for e in events]) if events else ["  none yet"]
    leader = document.get("leader")
    if isinstance(leader, dict) and "leading" in leader:
        steps = "yes" if leader["leading"] else "no (another replica holds the Lease)"
        lines += ["", f"this replica steps rollouts: {steps} (mode {leader.get('mode', '-')})"]
    return "\n".join(lines)


def _print_rollout(args: argparse.Namespace, answer: Any) -> int:
    """A command's answer as JSON; status as a table (``--json``: the document), only POOL's
    rollout when one is named."""
    if args.action != "status":
        print(json.dumps(answer, indent=1, sort_keys=True))
        return 0
    rollouts = answer.get("rollouts") or {}
    if args.pool is not None and args.pool not in rollouts:
        known = ", ".join(sorted(rollouts)) or "none"
        print(f"trimtab: no rollout for pool {args.pool!r} (pools with a rollout: {known})",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        if args.pool is not None:
            answer = {**answer, "rollouts": {args.pool: rollouts[args.pool]}}
        print(json.dumps(answer, indent=1, sort_keys=True))
    else:
        print(render_rollouts(answer, args.pool))
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    if args.action != "status" and not args.pool:
        print(f"trimtab: rollout {args.action} needs a POOL", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        target = _admin_target(args)
    except ConfigError as exc:
        print(f"trimtab: invalid config {args.config}:\n{exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with urllib.request.urlopen(_rollout_request(target, args.action, args.pool),
                                    timeout=10) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        print(f"trimtab: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        if exc.code == 401 and target.token is None:
            print("trimtab: the admin API wants a bearer token: pass --config with the "
                  "admin.auth the server uses", file=sys.stderr)
        return EXIT_BAD_INPUT if exc.code in (400, 404, 409) else 1
    except OSError as exc:
        print(f"trimtab: cannot reach the admin API at {target.base}: {exc}", file=sys.stderr)
        return 1
    return _print_rollout(args, answer)


_DELEGATED = {
    "classify": ("xds_server.classify", "serve the intent classifier (Envoy ext_proc, gRPC)"),
}
PLUGIN_GROUP = "trimtab.commands"  # development tools (trimtab_dev) register sim, load, bench


@cache
def _plugins() -> dict[str, str]:
    """Commands other installed packages add (name -> "module:function"); the product names
    none of them, so it never imports the development tools. A command whose top-level
    package is not installed is not offered: the container image's wheel is built without
    trimtab_dev but keeps the entry points pyproject declares (Dockerfile)."""
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    return {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP)
            if ep.name not in _DELEGATED and find_spec(ep.module.partition(".")[0]) is not None}


def _run_plugin(target: str, argv: list[str]) -> int:
    import importlib

    module, _, function = target.partition(":")
    return int(getattr(importlib.import_module(module), function or "main")(argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        return _run_plugin(_DELEGATED[argv[0]][0], argv[1:])
    if argv and argv[0] in _plugins():
        return _run_plugin(_plugins()[argv[0]], argv[1:])
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    handlers = {"serve": cmd_serve, "validate": cmd_validate, "rollout": cmd_rollout,
                "weights": cmd_weights, "agent": cmd_agent}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
