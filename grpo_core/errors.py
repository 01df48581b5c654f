"""The error every configuration check raises (a leaf, so rooms below the config can raise it too)."""


class ConfigError(ValueError):
    """Invalid configuration; the message names the field and what to do."""
