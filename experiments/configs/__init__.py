"""ml_collections configs: each module has ``get_config()``."""
