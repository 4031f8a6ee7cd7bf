"""A key's usage as the store reads it (``store/quota.py`` has the limits)."""

QUOTA_LOCK = 0x51_55_4F_54  # the first key of a quota's advisory lock ("QUOT"); the second is the name's hash
ACTIVE = "SELECT COUNT(*) AS n FROM jobs WHERE caller IS NOT DISTINCT FROM ? AND NOT terminal"
RECENT = (
    "SELECT created_at, num_tracks FROM jobs WHERE caller IS NOT DISTINCT FROM ? AND created_at > ? ORDER BY created_at"
)
