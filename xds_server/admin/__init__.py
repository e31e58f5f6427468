"""The admin HTTP API, the status page, its history, and trimtab's own metrics."""
