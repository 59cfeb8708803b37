"""The DLQ tools: ``consumer-proxy dlq inspect|report|merge|purge``.

Layers, top down (arrows point down only):

- ``commands``: the argparse subcommands and each command's flow (plan, confirm, run, print).
- ``kafka_ops``: the Kafka side with confluent-kafka: partitions and watermarks, the merge
  mark, inspect's peek, purge (delete records).
- ``jobs``: the Spark jobs (report, merge selection and write); ``spark``: the session, the
  Kafka connector lookup, the Java client's settings.
- ``render``: values, tables and the chart; ``reports``: the typed results every layer shares.
- ``mark`` and ``pacing``: pure logic (the per-record merge mark, the write-rate pacer).

The tools use the core (``consumer_proxy.core``), ``config``, ``errors`` and the ``dlq`` header
helpers; never the proxy's runtime (``proxy``, ``fetcher``, ``dispatcher``, ``flow``).
"""
