"""The dispatcher's MCP server (``/mcp``): songs for assistants, over the same job and upload services as the HTTP API.

- ``tools.py``: the tools, their words, and their arguments, copied from the HTTP API's models;
- ``calls.py``: what each tool does (the service's calls, with the caller's key);
- ``resources.py``: a finished take as a resource (``song://{job_id}/{track}``: MP3, ``.wav``), lyrics and style;
- ``server.py``: the SDK's lowlevel server, stateless Streamable HTTP, errors as the tools' errors.

It calls ``service/`` and reads ``jobs/``; never ``store/`` or ``dispatch/``, and never ``http/`` (which
mounts it). Its stdio twin for desktop clients, ``songserve mcp``, is ``songserve/cli/mcp_stdio.py``.
"""
