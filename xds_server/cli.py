"""The `trimtab` command line. Exit status 2 means bad input (config, arguments)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence

from . import __version__
from .config import ConfigError, load_config

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
    serve = sub.add_parser("serve", help="run the control plane in the foreground")
    serve.add_argument("--config", required=True, help="path to the YAML config")
    validate = sub.add_parser("validate", help="check a config; exit 2 naming what is wrong")
    validate.add_argument("--config", required=True, help="path to the YAML config")
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
    app = Trimtab(config, args.config)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    handlers = {"serve": cmd_serve, "validate": cmd_validate}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
