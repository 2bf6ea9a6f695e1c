"""The one base of quantgate's own errors. Every room may import it (the catalog room imports no other)."""


class QuantgateError(Exception):
    """A failure quantgate reports itself, in a message of one line a person can act on: the CLI prints it as
    `error: <message>` (a traceback only with --debug) and exits 1. Subclasses keep the builtin base their callers
    catch (ValueError, RuntimeError) beside this one."""
