"""The one error every config problem raises: the key, its value and what is allowed."""


class ConfigError(ValueError):
    """A configuration key or value that cannot be used."""
