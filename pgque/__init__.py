"""pgque: Kafka's partition model inside PostgreSQL.

Producers append events to an immutable log with :meth:`Client.send`; each
consumer reads the whole log through its own cursor, in batches cut by
ticks. :class:`AsyncClient` makes the same calls on asyncio. See the README
and docs/ for the guarantees.
"""

from pgque._version import __version__
from pgque.client import Client, connect, open_connection
from pgque.client_async import AsyncClient, connect_async, open_connection_async
from pgque.errors import (
    AccessDenied,
    BatchNotActive,
    ConnectError,
    ConsumerAccessDenied,
    ConsumerNotFound,
    CronUnavailable,
    DeadLetterNotFound,
    DependentObjects,
    EventNotInBatch,
    HandlerEndedTransaction,
    HandlerReturnedAwaitable,
    InvalidArgument,
    InvalidConfig,
    InvalidGrant,
    InvalidName,
    InvalidSlot,
    InvalidSlotCount,
    NewerSchema,
    NotReadCommitted,
    PartitionKeyTooLong,
    PayloadError,
    PgqueError,
    QueueAccessDenied,
    QueueExists,
    QueueInUse,
    QueueNotFound,
    SchemaNotOwned,
    SessionUnstable,
    SlotCountMismatch,
    SlotNotOwned,
    SlotSubscriptionError,
    StaleEpoch,
)
from pgque.info import ConsumerInfo, GroupStatus, QueueInfo, SlotOwner, SlotStatus
from pgque.schema import install, install_script, uninstall
from pgque.ticker import Ticker
from pgque.types import Batch, DeadLetter, Event, Fence, Message
from pgque.worker import Worker
from pgque.worker_async import AsyncWorker

__all__ = [
    "AccessDenied",
    "AsyncClient",
    "AsyncWorker",
    "Batch",
    "BatchNotActive",
    "Client",
    "ConnectError",
    "ConsumerAccessDenied",
    "ConsumerInfo",
    "ConsumerNotFound",
    "CronUnavailable",
    "DeadLetter",
    "DeadLetterNotFound",
    "DependentObjects",
    "Event",
    "EventNotInBatch",
    "Fence",
    "GroupStatus",
    "HandlerEndedTransaction",
    "HandlerReturnedAwaitable",
    "InvalidArgument",
    "InvalidConfig",
    "InvalidGrant",
    "InvalidName",
    "InvalidSlot",
    "InvalidSlotCount",
    "Message",
    "NewerSchema",
    "NotReadCommitted",
    "PartitionKeyTooLong",
    "PayloadError",
    "PgqueError",
    "QueueAccessDenied",
    "QueueExists",
    "QueueInUse",
    "QueueInfo",
    "QueueNotFound",
    "SchemaNotOwned",
    "SessionUnstable",
    "SlotCountMismatch",
    "SlotNotOwned",
    "SlotOwner",
    "SlotStatus",
    "SlotSubscriptionError",
    "StaleEpoch",
    "Ticker",
    "Worker",
    "__version__",
    "connect",
    "connect_async",
    "install",
    "install_script",
    "open_connection",
    "open_connection_async",
    "uninstall",
]
