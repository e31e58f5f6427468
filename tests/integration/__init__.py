"""End-to-end tests: the trimtab CLI as a subprocess, a real Envoy and fake backends."""
