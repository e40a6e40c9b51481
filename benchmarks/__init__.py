"""``manage.py counters_bench``: what the unread counter costs and gains, measured side by side.

One module per measurement: ``writes`` (insert throughput with no counter,
a naive counter and Tally), ``flush`` (keys applied per second against a raw
SQL bound), ``reads`` (``get_count`` against ``COUNT(*)``) and ``memory``
(the flusher's peak RSS). ``runner`` ties them together around bench data of
its own (``data``) and ``report`` turns the results into a table and targets.
"""
