"""The uploaded adapters' SQL (``store/adapters.py`` has the rules)."""

from songserve.api.store.connector import marks

ADAPTER_COLUMNS = ("name", "caller", "bytes", "sha256", "rank", "targets", "created_at")

# A name is taken once: the second insert of a name changes nothing (both engines know ON CONFLICT).
INSERT = (
    f"INSERT INTO adapters ({', '.join(ADAPTER_COLUMNS)}) VALUES ({marks(len(ADAPTER_COLUMNS))})"
    " ON CONFLICT (name) DO NOTHING"
)
LOAD = "SELECT * FROM adapters WHERE name=?"
ALL = "SELECT * FROM adapters ORDER BY name"
COUNT_BY = "SELECT COUNT(*) AS n FROM adapters WHERE caller IS NOT DISTINCT FROM ?"
DELETE = "DELETE FROM adapters WHERE name=?"
