"""The config contract: YAML in, a frozen, validated `Config` out.

The package's public entry point (re-exported here; code inside the project imports each
name from the module that defines it):

* `load_config(path)` / `parse_config(data)` -> `Config`, raising `ConfigError`
  (xds_server/config/load.py: reading within bounds, YAML, error messages);
* `Config` and its sections (xds_server/config/schema.py; a pool's parts in pools.py);
* the rules that span sections (xds_server/config/checks.py);
* `HostPort` / `parse_host_port` (xds_server/config/addresses.py).

Nothing here imports the rest of trimtab: `trimtab validate` needs only pydantic and PyYAML.
"""

from xds_server.config.addresses import HostPort, parse_host_port
from xds_server.config.load import ConfigError, load_config, parse_config
from xds_server.config.schema import Config

__all__ = ["Config", "ConfigError", "HostPort", "load_config", "parse_config",
           "parse_host_port"]
