"""``trimtab serve`` with a :class:`HookedController`, for the end-to-end tests.

    python -m tests.support.launcher --config CONFIG --hooks 127.0.0.1:PORT

runs the real serve path (``xds_server.cli.serve_app``) and, beside the admin API, a hooks
server on ``--hooks`` (loopback, tests only)::

    POST /invalid-weight {"pool": "alpha", "enabled": true}

makes the pool's first endpoint carry weight 0 (which Envoy NACKs) until disabled.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from tests.support.hooks import HookedController, invalid_weight_mutator
from xds_server.app import Trimtab
from xds_server.cli import serve_app, setup_logging
from xds_server.config.addresses import parse_host_port
from xds_server.config.schema import Config


class HookedTrimtab(Trimtab):
    """Trimtab with a :class:`HookedController` and the hooks server next to it."""

    hooks_address = "127.0.0.1:0"

    def __init__(self, config: Config, config_path: str | Path | None = None) -> None:
        super().__init__(config, config_path, controller_type=HookedController)
        self.injected: set[str] = set()  # pools with an invalid CLA
        self._hooks: web.AppRunner | None = None

    @property
    def hooked(self) -> HookedController:
        assert isinstance(self.controller, HookedController)
        return self.controller

    async def start(self) -> None:
        await super().start()
        app = web.Application()
        app.router.add_post("/invalid-weight", self.invalid_weight)
        self._hooks = web.AppRunner(app, access_log=None)
        await self._hooks.setup()
        hooks = parse_host_port(self.hooks_address)
        await web.TCPSite(self._hooks, hooks.host, hooks.port).start()

    async def close(self) -> None:
        if self._hooks is not None:
            await self._hooks.cleanup()
            self._hooks = None
        await super().close()

    async def invalid_weight(self, request: web.Request) -> web.Response:
        body = await request.json()
        pool = str(body.get("pool", ""))
        if pool not in {p.name for p in self.controller.config.pools}:
            return web.json_response({"error": f"unknown pool {pool!r}"}, status=404)
        self.injected.discard(pool)
        if body.get("enabled"):
            self.injected.add(pool)
        self.hooked.mutators[:] = [invalid_weight_mutator(p) for p in sorted(self.injected)]
        published = self.controller.publish()
        return web.json_response({"pool": pool, "enabled": bool(body.get("enabled")),
                                  "published": published})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.launcher")
    parser.add_argument("--config", required=True)
    parser.add_argument("--hooks", required=True, help="host:port of the hooks server")
    args = parser.parse_args(argv)
    setup_logging("info", "text")
    HookedTrimtab.hooks_address = args.hooks
    return serve_app(args.config, HookedTrimtab)


if __name__ == "__main__":
    sys.exit(main())
