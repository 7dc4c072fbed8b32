-- Migration 10 (pgque 0.9.0): a sleeping ticker that sends wake.
--
-- An idle Ticker stops polling every few milliseconds: it sets every queue's
-- queue_ticker_asleep, listens on the ticker channel and polls only now and
-- then. A send into a queue whose flag is set notifies that channel (the
-- notification carries nothing), so the first event after a quiet spell is
-- ticked at once instead of at the next poll. The flag is written when the
-- ticker falls asleep and when it wakes, never per send or per poll
-- (code/ticker/sleep.sql). Existing queues start with the ticker awake.

alter table pgque.queue
    add column if not exists queue_ticker_asleep boolean not null default false;
