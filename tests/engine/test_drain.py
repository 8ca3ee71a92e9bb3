"""A server shutting down ends every answer in flight within the drain timeout, even
while the engine is inside one long step (a prefill chunk on a slow machine can take
longer than uvicorn's backstop): the stream gets its error event and ``[DONE]``, and the
engine ends the request at its next step (uvicorn in this process, on a free port of
127.0.0.1; the small generated model behind a gate that holds its forward pass)."""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
import time

import httpx

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.engine.serve.draining import DrainingServer

DRAIN_S = 0.5


class GatedModel:
    """The model, whose forward pass waits while ``closed`` is set (a step that lasts)."""

    def __init__(self, model) -> None:
        self.model = model
        self.closed = threading.Event()
        self.entered = threading.Event()  # a forward pass is waiting at the gate
        self.opened = threading.Event()

    def __call__(self, *args, **kwargs):
        if self.closed.is_set():
            self.entered.set()
            self.opened.wait(60)
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def test_a_stream_in_flight_ends_with_its_error_event_while_the_step_lasts(loaded):
    gate = GatedModel(loaded.model)
    engine = Engine(dataclasses.replace(loaded, model=gate), EngineConfig(page_size=16))
    server = KVTierServer(engine, ServerConfig("kvtier-default"))
    server.start()
    uv = DrainingServer(server, DRAIN_S, "warning")
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        gate.closed.set()  # from now on the engine's step holds at the model

        def read() -> None:
            body = {"prompt": "a prompt whose prefill lasts " * 4, "max_tokens": 50, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                lines.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert gate.entered.wait(30), "the request's prefill never started"
        uv.handle_exit(signal.SIGINT, None)  # what Ctrl-C does once the server runs
        reader.join(DRAIN_S + 5)
        assert not reader.is_alive(), f"the stream did not end while the step lasted: {lines}"
        assert "shutting down" in lines[-2] and lines[-1] == "data: [DONE]", lines
    finally:
        gate.opened.set()
        thread.join(30)
        server.close()
    assert not thread.is_alive()
