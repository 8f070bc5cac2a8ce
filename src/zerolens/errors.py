"""The errors zerolens tells apart, and how one is said in a line."""
import contextlib


class UserError(ValueError):
    """A bad flag, an impossible configuration, a missing dependency, or a user's model or batch that
    breaks the contract: reported in one line, exit code 2, before any worker starts."""


def one_line_error(error: Exception) -> str:
    """A pydantic ValidationError's first error as "where: what (input ...)", anything else's first line."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            first = errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            return f"{where}: {first['msg']} (got {first.get('input')!r})"
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
