"""The dispatcher: job API, job store, scheduler over the worker pool, artifact store."""
