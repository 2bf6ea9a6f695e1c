"""One-line error messages: what users, run rows and logs see instead of a traceback."""


def one_line(e: BaseException, limit: int = 300) -> str:
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    message = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."
