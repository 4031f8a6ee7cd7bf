"""ACE-Step's answer wrapper: ``{data, code, error, timestamp, extra}``.

Its clients test ``code`` in the body, not the HTTP status (the Studio: ``code === 200``), and
show ``error``; ``timestamp`` is milliseconds since the epoch. ACE-Step always sends ``extra: null``;
here ``/release_task`` puts there what was ignored or read differently.
"""

from __future__ import annotations

import time
from typing import Any


def wrap(data: Any, code: int = 200, error: str | None = None, extra: Any = None) -> dict[str, Any]:
    return {"data": data, "code": code, "error": error, "timestamp": int(time.time() * 1000), "extra": extra}
