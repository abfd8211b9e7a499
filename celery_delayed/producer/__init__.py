"""The producer side: turning ``apply_later`` calls into jobs and messages (nothing here writes).

- :mod:`.prepare`: validate a call, choose its id and shard, build its record.
- :mod:`.message`: the kombu message ``apply_async`` would send (built once).
- :mod:`.template`: a cached envelope per task and options (the fast path).
- :mod:`.misfire`: ``expires``, ``max_lateness`` and ``misfire`` as record fields.
"""
