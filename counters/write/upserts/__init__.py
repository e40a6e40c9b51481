"""The appliers of counter rows, one per kind of database: an upsert per batch, in key order.

:mod:`counters.write.apply` picks one: ``INSERT … ON CONFLICT`` on PostgreSQL and SQLite
(:mod:`~counters.write.upserts.on_conflict`), an additive ``UPDATE`` then ``ON DUPLICATE
KEY UPDATE`` on MySQL and MariaDB (:mod:`~counters.write.upserts.mysql`), and an upsert
over the key's columns for counters with a composite key
(:mod:`~counters.write.upserts.composite`).
"""
