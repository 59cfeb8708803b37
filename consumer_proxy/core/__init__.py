"""The pure core: decisions with no I/O, no asyncio and no Kafka client.

Everything here runs on plain data and an injected clock, so it is tested over thousands of
random schedules (``tests/sim``) without a broker. The I/O shell (``group``, ``fetcher``,
``dispatcher``, ``dlq``) executes the plans these modules return. Arrows point down into this
package, never out of it.
"""
