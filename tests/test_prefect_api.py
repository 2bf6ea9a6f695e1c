"""flows/prefect_api.py starts Prefect's temporary API server itself, in a session of its own (issue 44): its command
must stay Prefect's (SubprocessASGIServer._run_uvicorn_command), which a new Prefect may change."""

from __future__ import annotations

import os
import types

from quantgate.flows import prefect_api


def test_the_temporary_servers_command_and_environment_are_prefects(monkeypatch):
    from prefect.server.api import server as prefect_server

    server = prefect_server.SubprocessASGIServer(port=18765)
    try:
        seen: dict[str, object] = {}
        monkeypatch.setattr(prefect_server, "subprocess",
                            types.SimpleNamespace(Popen=lambda **kwargs: seen.update(prefect=kwargs)))
        server._run_uvicorn_command()

        def spawn_session(cmd, log, env, **kwargs):
            seen["ours"] = {"args": list(cmd), "env": {**os.environ, **env}, "log": log, **kwargs}

        monkeypatch.setattr(prefect_api.processes, "spawn_session", spawn_session)
        prefect_api._command_in_own_session(server)
    finally:
        prefect_server.SubprocessASGIServer._instances.pop(18765, None)
    prefect, ours = seen["prefect"], seen["ours"]
    assert ours["args"] == prefect["args"]
    assert ours["env"] == prefect["env"]
    assert ours["log"] is None and ours["service"] is True  # output where ours goes; spared by an interrupt's cleanup
