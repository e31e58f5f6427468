"""The config contract: YAML in, a frozen, validated `Config` out."""
