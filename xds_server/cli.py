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

from . import __version__
from .config import ConfigError, load_config
from .rollout import RolloutStateError

EXIT_BAD_INPUT = 2


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage()}
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
    serve = sub.add_parser("serve", help="run the control plane in the foreground")
    serve.add_argument("--config", required=True, help="path to the YAML config")
    validate = sub.add_parser("validate", help="check a config; exit 2 naming what is wrong")
    validate.add_argument("--config", required=True, help="path to the YAML config")
    weights = sub.add_parser("weights", help="read telemetry once; show every input and weight")
    weights.add_argument("--config", required=True, help="path to the YAML config")
    weights.add_argument("--json", action="store_true", help="JSON rows instead of a table")
    agent = sub.add_parser("agent", help="serve this node's GPUs (NVML) in DCGM metric names")
    agent.add_argument("--listen", default="0.0.0.0:9400", help="host:port (default 0.0.0.0:9400)")
    ro = sub.add_parser("rollout", help="show or steer canary rollouts through the admin API")
    ro.add_argument("action", choices=["status", "pause", "resume", "promote", "abort"])
    ro.add_argument("pool", nargs="?", help="the pool (required except for status)")
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


async def _serve(args: argparse.Namespace) -> int:
    from .app import Trimtab

    config = load_config(args.config)
    try:
        app = Trimtab(config, args.config)
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
    except OSError as exc:
        await app.close()
        print(f"trimtab: cannot start: {exc}", file=sys.stderr)
        return 1
    await app.run(stop)
    logging.getLogger("trimtab").info("shut down cleanly")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        load_config(args.config)
    except ConfigError as exc:
        print(f"trimtab: invalid config {args.config}:\n{exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return asyncio.run(_serve(args))


def cmd_weights(args: argparse.Namespace) -> int:
    from .explain import explain

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"trimtab: invalid config {args.config}:\n{exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(explain(config, as_json=args.json))
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from .config import parse_host_port
    from .nvml_agent import NvmlUnavailable, PynvmlReader, serve_agent

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
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_agent(reader, where.host, where.port))
    return 0


def _admin_url(args: argparse.Namespace) -> str:
    if args.admin:
        return args.admin.rstrip("/")
    if args.config:
        address = load_config(args.config).admin.host_port
        host = "127.0.0.1" if address.host in ("0.0.0.0", "::") else address.host
        return f"http://{host}:{address.port}"
    return "http://127.0.0.1:19100"


def cmd_rollout(args: argparse.Namespace) -> int:
    if args.action != "status" and not args.pool:
        print(f"trimtab: rollout {args.action} needs a POOL", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        base = _admin_url(args)
    except ConfigError as exc:
        print(f"trimtab: invalid config {args.config}:\n{exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.action == "status":
        request = urllib.request.Request(f"{base}/v1/rollouts")
    else:
        request = urllib.request.Request(f"{base}/v1/rollouts/{args.pool}/{args.action}",
                                         data=b"{}", method="POST",
                                         headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            print(json.dumps(json.load(response), indent=1, sort_keys=True))
            return 0
    except urllib.error.HTTPError as exc:
        print(f"trimtab: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return EXIT_BAD_INPUT if exc.code in (400, 404, 409) else 1
    except OSError as exc:
        print(f"trimtab: cannot reach the admin API at {base}: {exc}", file=sys.stderr)
        return 1


_DELEGATED = {
    "sim": ("xds_server.sim.cli", "run the LLM fleet simulator (vLLM-compatible servers)"),
    "load": ("xds_server.loadgen.cli", "drive an open-loop LLM workload at a URL"),
    "bench": ("xds_server.bench.cli", "compare balancing policies through a real Envoy"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import importlib

        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]))
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    handlers = {"serve": cmd_serve, "validate": cmd_validate, "rollout": cmd_rollout,
                "weights": cmd_weights, "agent": cmd_agent}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
