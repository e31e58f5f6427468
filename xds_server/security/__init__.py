"""Security of the xDS port and the admin API: TLS (`tls`), certificate identities
(`identity`), node authorisation (`authz`), limits (`limits`), the admin bearer token
(`admin_auth`), and the stream guard that composes them (`guard`)."""
