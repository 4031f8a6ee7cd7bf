"""Webhooks: the events a job's changes make, and their delivery, signed, from the store's outbox.

A job's change writes its events into the outbox in the same transaction (``store/outbox.py``);
the sender claims due events and tries them, so no event is lost to a restart and none blocks a job.

    events.py   which events a job asked for, and each one's body
    sender.py   the ``webhooks`` loop: claim, sign, send, retry with backoff
    sign.py     Standard Webhooks signatures (``webhook-id``, ``-timestamp``, ``-signature``)
    targets.py  ``WEBHOOK_ALLOW``: where a webhook may be sent, checked at submit and at every try
"""
