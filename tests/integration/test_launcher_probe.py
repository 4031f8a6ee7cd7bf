"""The launcher's port questions and the process group's socket defaults, in-process (the real-process
proofs are test_launcher_ports.py and test_ports.py)."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from songserve.cli.launcher_probe import Port, health_word, port_problem
from songserve.pipeline.checkpoints import process_group
from tests.support.servers import free_port


def test_free_ports_have_no_problem():
    assert port_problem([Port("127.0.0.1", free_port(), "the dispatcher", "API_PORT")]) is None


def test_a_port_in_use_is_named_with_its_setting():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))  # every interface: our loopback bind collides with it too
        sock.listen()
        port = sock.getsockname()[1]
        problem = port_problem([Port("127.0.0.1", port, "worker 0", "WORKER_BASE_PORT")])
    assert problem == f"port {port} (worker 0) on 127.0.0.1 is in use; set WORKER_BASE_PORT to a free port"


def test_one_port_given_to_two_services_is_refused_before_binding():
    port = free_port()
    ports = [
        Port("127.0.0.1", port, "the dispatcher", "API_PORT"),
        Port("127.0.0.1", port, "worker 1", "WORKER_BASE_PORT"),
    ]
    assert port_problem(ports) == (
        f"port {port} is given to both the dispatcher and worker 1; set API_PORT or WORKER_BASE_PORT apart"
    )


def test_a_port_past_65535_is_refused():
    problem = port_problem([Port("127.0.0.1", 65536, "worker 1", "WORKER_BASE_PORT")])
    assert problem == "port 65536 (worker 1) is no port (1-65535); set WORKER_BASE_PORT to a free one"


@pytest.mark.parametrize(
    ("answer", "word"),
    [
        ({"status": "idle", "launch_nonce": "ours"}, "ready"),
        ({"status": "initializing", "launch_nonce": "ours"}, "starting"),
        ({"status": "idle", "launch_nonce": "theirs"}, "other"),
        ({"status": "ok"}, "other"),  # an instance started by hand, or an older one: no nonce
        ("<html>", "other"),
    ],
)
def test_health_word_tells_our_child_from_another_process(answer, word):
    body = (json.dumps(answer) if isinstance(answer, dict) else answer).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert health_word(f"http://127.0.0.1:{server.server_address[1]}", "ours") == word
    finally:
        server.shutdown()
        server.server_close()


def test_health_word_is_none_while_nothing_listens():
    assert health_word(f"http://127.0.0.1:{free_port()}", "ours") == "none"


def test_gloo_and_nccl_listen_on_loopback_unless_told_otherwise(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so that the value set below is undone
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")  # asked for: kept
    process_group._backend_sockets_on_loopback()
    lo = process_group.loopback_interface()
    assert lo in ("lo", "lo0")
    assert os.environ["GLOO_SOCKET_IFNAME"] == lo
    assert os.environ["NCCL_SOCKET_IFNAME"] == "eth7"
