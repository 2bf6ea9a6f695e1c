"""The one base of quantgate's own errors, and one-line messages: what users, run rows and logs see instead of a
traceback. Every room may import it."""


class QuantgateError(Exception):
    """A failure quantgate reports itself, in a message of one line a person can act on: the CLI prints it as
    `error: <message>` (a traceback only with --debug) and exits 1. Subclasses keep the builtin base their callers
    catch (ValueError, RuntimeError) beside this one."""


class CatalogError(QuantgateError, ValueError):
    """A catalog or policy file that does not validate; the message is one line."""


def one_line(e: BaseException, limit: int = 300) -> str:
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    message = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."
