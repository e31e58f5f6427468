"""Development tools: the fleet simulator, load generator, `trimtab bench`, demos and a real-Envoy runner.

The product (`xds_server`) never imports this package; `trimtab sim|load|bench` reach it through
the `trimtab.commands` entry-point group."""
