"""Where pool endpoints come from besides the config: Kubernetes EndpointSlices."""
