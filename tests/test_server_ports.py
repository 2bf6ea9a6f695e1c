"""start_server's choice of port when engines start beside it and bind ports of their own. `vllm serve` needs a
GPU, so a stand-in `vllm` package, first on the server's PYTHONPATH, takes its command line (the real one of
vllm_serve_command) and serves /health on the port it names; the choice, the refusal and the retries are the
real code. That vLLM words a taken port as the stand-in does ("Address already in use", errno 98) is Python's
socket error, which its API server raises when it binds."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest

from quantgate.tasks.adapters.speed import server as server_module
from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.adapters.speed.server import PORT_TRIES, PortTaken, free_port, start_server

_STAND_IN = textwrap.dedent(
    """
    import argparse, http.server, os, pathlib, socket, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("serve"); parser.add_argument("model")
    parser.add_argument("--host"); parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    taken = pathlib.Path(os.environ["STAND_IN_TAKEN_ONCE"])
    if not taken.exists():  # the first start finds its port bound by someone else in the meantime
        taken.write_text(str(args.port))
        raise OSError(98, "Address already in use")
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer((args.host, args.port), Health).serve_forever()
    """
)


@pytest.fixture
def stand_in_vllm(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "stand-in"
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (d / "__init__.py").write_text("")
    (cli / "main.py").write_text(_STAND_IN)
    return {"PYTHONPATH": str(root), "STAND_IN_TAKEN_ONCE": str(tmp_path / "taken-once")}


def test_a_port_taken_before_or_while_the_server_binds_it_is_replaced(tmp_path, stand_in_vllm, monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    picks = iter([taken])  # the first pick is a port another process holds by the time the server starts
    monkeypatch.setattr(server_module, "free_port", lambda host: next(picks, None) or free_port(host))
    try:
        with start_server("model", env=stand_in_vllm, log_path=tmp_path / "serve.log", ready_timeout_s=30) as srv:
            port = int(srv.base_url.rsplit(":", 1)[1])
            bound_then_refused = int(Path(stand_in_vllm["STAND_IN_TAKEN_ONCE"]).read_text())
            # the held port was passed over before starting; the next one failed in the server's own bind
            assert port not in (taken, bound_then_refused) and bound_then_refused != taken
            assert srv.running
    finally:
        held.close()
    assert "Address already in use" in (tmp_path / "serve.log").read_text()


def test_a_port_given_is_refused_when_taken_and_the_tries_are_bounded(tmp_path, stand_in_vllm, monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    try:
        with pytest.raises(PortTaken, match=f"port {taken} .* already in use"):
            start_server("model", port=taken, env=stand_in_vllm, log_path=tmp_path / "given.log")
        monkeypatch.setattr(server_module, "free_port", lambda host: taken)
        with pytest.raises(PortTaken):
            start_server("model", env=stand_in_vllm, log_path=tmp_path / "every.log")
        assert PORT_TRIES > 1 and not (tmp_path / "every.log").exists()  # refused each time before starting
    finally:
        held.close()
    with pytest.raises(ServingError, match="exited with code 1 before it was ready"):
        # a failure that is not the port's is not retried: the stand-in without its marker variable fails at once
        start_server("model", env={"PYTHONPATH": stand_in_vllm["PYTHONPATH"]}, log_path=tmp_path / "other.log")
    assert (tmp_path / "other.log").read_text().count("Traceback") == 1
