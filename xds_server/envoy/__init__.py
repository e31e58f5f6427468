"""Envoy resources built from config and weights: clusters, endpoints, listener, routes."""
