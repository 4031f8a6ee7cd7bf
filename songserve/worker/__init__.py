"""The worker: one process per GPU serving one track at a time over HTTP."""
