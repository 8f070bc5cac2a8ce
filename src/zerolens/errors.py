"""The errors zerolens tells apart, and how one is said in a line."""
import contextlib
import signal


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


@contextlib.contextmanager
def users_code(what: str):
    """Whatever the user's code raises inside (their model, batch function or factory: theirs to fix),
    as one UserError line, "what: Type: its first line"; a UserError goes through as it is."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{what}: {type(e).__name__}: {one_line_error(e)}") from None


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM reached the `zerolens` process: what runs is ended (every rank and
    pool process), an unfinished run folder says so, and the command exits 128 + the signal's number
    (130, 143). A KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def interrupts_raised(on_signal=None):
    """While inside, SIGINT and SIGTERM raise Interrupted in the main thread (SIGTERM would otherwise end
    the process at once, leaving what it started running), after `on_signal(signum)` where given; the
    handlers before are put back after. Outside the main thread, where Python takes no handlers, it
    changes nothing."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if on_signal is not None:
            on_signal(signum)
        raise Interrupted(signum)
    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)
