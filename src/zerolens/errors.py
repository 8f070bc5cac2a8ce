"""The errors zerolens tells apart."""


class UserError(ValueError):
    """A bad flag, an impossible configuration, a missing dependency, or a user's model or batch that
    breaks the contract: reported in one line, exit code 2, before any worker starts."""
