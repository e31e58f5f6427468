"""Security of the xDS port and the admin API: TLS, identity, authorisation, limits."""
