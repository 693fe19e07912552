"""hotweights: a weight cache daemon and hot-standby failover for LLM inference engines.

This package holds the shared bottom layer (errors, paths, model layout, dtype and quantization
vocabulary, the engine contract); the layers above it install as ``hotweights.cache``,
``hotweights.standby``, ``hotweights.controller`` and ``hotweights.chaos`` and import one way,
in that order (``docs/architecture.md``; enforced by the import-linter contracts in pyproject.toml).
"""
