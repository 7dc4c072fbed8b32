-- Migration 11 (pgque 0.10.0): what the polls need to skip idle queues cheaply.
--
-- The ticker's poll used to probe the event tables of every queue with
-- nothing pending by its sequence, at every poll, for events that a tick
-- missed (sent before it by a transaction that committed after it). A tick
-- now records when that can no longer happen: tick_settled once nothing can
-- be missed any more, and tick_settle_xid, the transaction id below which
-- every transaction it may have missed lies (code/log/tick.sql). Ticks made
-- before this migration are neither: they are probed, as before, until the
-- queue's next tick.

alter table pgque.tick
    add column if not exists tick_settled boolean not null default false,
    add column if not exists tick_settle_xid xid8;

-- And maintenance's record of the event tables that may hold events besides
-- the current one (bit n for table n; code/ticker/maint.sql): a pass over
-- every queue looks closely only at queues with such a table or with another
-- step due, in one statement, instead of probing every table of every queue.
-- Existing queues start with every table marked, and their next pass clears
-- the marks of the tables it finds empty.

alter table pgque.queue
    add column if not exists queue_used_tables bigint not null default 0;
update pgque.queue set queue_used_tables = -1 where queue_used_tables = 0;
