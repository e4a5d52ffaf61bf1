"""The Redis broker transport a FairQueue worker reads with: kombu's, surviving every broker
restart.

On a lost broker connection Celery's consumer `collect()`s the connection: that closes its
channels (best effort: the broker is down) and then detaches their transport. A channel
whose close failed there, and every message it delivered, still reaches Redis through
that transport: closed again, it retries restoring its unacknowledged deliveries; a job
that ends acknowledges its message. With the transport detached, kombu's Redis channel
raises AttributeError for both instead of a connection error, which Celery takes for
unrecoverable: the worker stops consuming for good while its process lives on, and every
delivery waits for a worker that never reads.

Here a detached channel raises the connection error it is: Celery logs it and reconnects,
the deliveries stay in the broker's unacknowledged set (redelivered after the visibility
timeout), and FairQueue's leases re-dispatch any job whose run did not start.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

#: The broker URL scheme this transport serves. (On rediss:// kombu derives TLS defaults
#: from the scheme's name, so such a broker keeps kombu's transport.)
REDIS_SCHEME = "redis"
TRANSPORT = "fairqueue.jobs.broker_transport:Transport"


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:
            raise RedisConnectionError("the broker connection this channel used was closed")
        return super()._connparams(asynchronous=asynchronous)


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel


def transport_for(broker_url: str, current: Any) -> str | None:
    """The transport a FairQueue worker reads `broker_url` with, given the app's
    `broker_transport`: None to leave it (not Redis, or a transport the project chose)."""
    scheme = broker_url.partition("://")[0].lower()
    if scheme != REDIS_SCHEME or current not in (None, "", scheme):
        return None
    return TRANSPORT
