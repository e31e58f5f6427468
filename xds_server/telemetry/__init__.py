"""Telemetry: reading model-server and GPU pages (scrape, PromQL, static) into readings."""
