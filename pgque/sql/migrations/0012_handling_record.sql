-- Migration 12 (pgque 0.12.0): the record of handler calls that `pgque verify`
-- checks (code/slots/handling.sql, code/info/verify.sql).
--
-- A Worker started with record=True writes one row per handler call of a
-- group's events: which event (its id, batch, retry count and key), which
-- slot (by its subscription, so the rows go with the group), under which
-- epoch, by which worker, when the call started and ended on the worker's
-- clock, and how it ended. Only workers that record write here; nothing else
-- reads it. The rows are inserted, never updated; forget_handling deletes a
-- group's, and unsubscribing it (or dropping its queue) deletes them with its
-- subscriptions (pgque._unsubscribe). No foreign key to pgque.subscription:
-- its check, a statement per row, cost more than the insert.

create table if not exists pgque.handling (
    hd_sub     integer not null,
    hd_ev_id   bigint not null,
    hd_batch   bigint not null,
    hd_retry   integer not null,
    hd_key     text,
    hd_epoch   bigint,
    hd_worker  text not null,
    hd_started timestamptz not null,
    hd_ended   timestamptz not null,
    hd_outcome "char" not null check (hd_outcome in ('o', 'f', 'd')),  -- ok, failed, dead
    check (hd_ended >= hd_started),
    check (octet_length(hd_key) <= 512)
);
create index if not exists handling_sub_idx on pgque.handling (hd_sub, hd_ev_id);

-- When the group's recording began (the first start_recording since the last
-- forget_handling): the verifier checks the events sent from then on.
alter table pgque.consumer_group
    add column if not exists cg_recorded_since timestamptz;
