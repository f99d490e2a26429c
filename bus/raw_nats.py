"""The bus layer's yardstick: the same job done with plain nats-py, as a careful hand-written
client would do it. Only `ops/bench/bus.py` uses it. It lives in `bus/` (the only nats importer)
but uses none of its modules: a yardstick must not go through what it measures.

- `raw_declare`: a file-backed stream with a duplicate window and one durable pull consumer;
- `raw_publish`: `js.publish_async` with a `Nats-Msg-Id` per message and a window of
  outstanding PubAcks;
- `raw_consume`: `pull_subscribe_bind(...).fetch(batch)` then `msg.ack()` per message, after
  an optional `decode` of the payload.
Each takes `started`, an async hook awaited once connected, right before the timed work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig


async def raw_declare(
    url: str, stream: str, subject: str, consumer: str, *, max_ack_pending: int
) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=stream, subjects=[subject], storage=StorageType.FILE, duplicate_window=120
        )
    )
    await js.add_consumer(
        stream,
        ConsumerConfig(
            durable_name=consumer,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=60,
            max_ack_pending=max_ack_pending,
        ),
    )
    await nc.close()


async def raw_publish(
    url: str,
    subject: str,
    items: Sequence[Any],
    msg_ids: Sequence[str],
    encode: Callable[[Any], bytes],
    *,
    window: int,
    started: Callable[[], Awaitable[None]],
) -> None:
    """Publish `encode(item)` for every item and wait for every PubAck."""
    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=window)
    await started()
    futs = []
    for item, msg_id in zip(items, msg_ids, strict=True):
        futs.append(await js.publish_async(subject, encode(item), headers={"Nats-Msg-Id": msg_id}))
        if len(futs) >= window:
            await asyncio.gather(*futs)
            futs = []
    await asyncio.gather(*futs)
    await nc.close()


async def raw_consume(
    url: str,
    stream: str,
    consumer: str,
    n: int,
    decode: Callable[[bytes], Any] | None,
    *,
    batch: int,
    started: Callable[[], Awaitable[None]],
) -> int:
    """Fetch, decode and ack `n` messages; returns the number of fetch calls."""
    nc = await nats.connect(url)
    sub = await nc.jetstream().pull_subscribe_bind(consumer, stream=stream)
    await started()
    got = fetches = 0
    while got < n:
        fetches += 1
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            continue
        for msg in msgs:
            if decode is not None:
                decode(msg.data)
            await msg.ack()
        got += len(msgs)
    await nc.flush()
    await nc.close()
    return fetches
