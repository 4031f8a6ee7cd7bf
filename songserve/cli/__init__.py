"""The command line: the ``songserve`` command and the launcher's helper.

Each of these talks to a running service over HTTP or asks the operating system; none imports a
service's code, only the contract (``songserve.schemas``) and the HTTP client's settings
(``songserve.http.keepalive``).

    commands.py        ``songserve generate …``, ``songserve status`` (``python -m songserve``)
    mcp_stdio.py       ``songserve mcp``: a stdio MCP server relaying to a dispatcher's ``/mcp``
    launcher_probe.py  ``run_backend.sh``'s questions: are its ports free; is the process on a port its child
"""
