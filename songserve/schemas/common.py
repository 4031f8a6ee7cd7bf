"""What the wire models of both services share: the patterns that bound names and ids, and a percent.

Every worker field is bounded; names and ids also have a pattern (no newline to forge a log line,
no control characters in a name). pydantic refuses lone surrogates in any string ("\\ud800" is
valid JSON but not valid Unicode). Bad input is a 422 naming the field, never a 500.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import PlainSerializer

NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
ID_PATTERN = r"^[A-Za-z0-9_.-]*$"
WORD_PATTERN = r"^[A-Za-z_]*$"
ADAPTER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # an adapter's name: its folder in ADAPTERS_DIR
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # its two files (PEFT's names)
MAX_ADAPTER_SCALE = 4.0
SHA256_PATTERN = r"^[0-9a-f]{64}$"
FILE_NAME_PATTERN = r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,200})?$"  # a plain file name, as /download serves (or none)
JOB_ID_PATTERN = r"^[a-f0-9]{8,64}$"  # the dispatcher's job ids (16 hex digits; older ones may differ in length)
MAX_SEED = 2**63 - 1  # fits SQLite's INTEGER and torch's manual_seed


def _whole_as_int(value: float) -> int | float:
    # float(): a default written as an int (0) reaches here unvalidated when the JSON schema is made
    return int(value) if float(value).is_integer() else value


# A percent reads as a float (the reference may send one); ours are whole and go out as ints, as they always did.
Percent = Annotated[float, PlainSerializer(_whole_as_int)]
