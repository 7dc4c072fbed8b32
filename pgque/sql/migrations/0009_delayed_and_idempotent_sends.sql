-- Migration 9 (pgque 0.7.0): delayed delivery and idempotency keys.
--
-- A delayed event waits in pgque.delayed_event until it falls due; the tick
-- that first passes its time moves it into the log (code/log/delay.sql). An
-- idempotency key is remembered in pgque.idempotency_key with the id of the
-- event it first sent, for the queue's idempotency window
-- (code/log/idempotency.sql). Both tables are written by INSERT only and
-- rotate like the retry queue: two partitions, the one not written emptied by
-- TRUNCATE (code/ticker/rotation.sql), so neither leaves dead rows.

-- An event that waited as a delayed event enters the log with a new id, in
-- the log's order; ev_delayed_id keeps the id its send returned (null for an
-- event sent at once). The event tables of existing queues get it from their
-- parents; a pause policy's held events and the retries keep it too.
alter table pgque.event_template add column if not exists ev_delayed_id bigint;
do $events$
declare
    v_id integer;
begin
    for v_id in select q.queue_id from pgque.queue q loop
        execute pg_catalog.format('alter table pgque.%I add column if not exists ev_delayed_id bigint',
                                  'event_' || v_id);
    end loop;
end
$events$;
alter table pgque.held_event add column if not exists ev_delayed_id bigint;
alter table pgque.retry_queue add column if not exists ev_delayed_id bigint;

-- How long a queue remembers an idempotency key.
alter table pgque.queue
    add column if not exists queue_idempotency_window interval not null default '24 hours';

do $window$
begin
    if not exists (select from pg_catalog.pg_constraint
                    where conname = 'queue_idempotency_window_check'
                      and conrelid = 'pgque.queue'::pg_catalog.regclass) then
        alter table pgque.queue add constraint queue_idempotency_window_check
            check (queue_idempotency_window > interval '0'
                   and queue_idempotency_window <= interval '30 days');
    end if;
end
$window$;

-- The delayed events: an event sent to enter the log at de_due, with the id
-- its send returned (ev_id, from the queue's event sequence) and the
-- transaction that sent it (ev_txid, kept when the rotation copies the
-- row). Never updated or deleted: a row is moved once the queue's newest tick
-- has passed its due time and sees its transaction (delay.sql), and the
-- partition it is in is emptied later. No foreign key to pgque.queue: the
-- rows of a dropped queue are left to the rotation, which copies none of them.
create table if not exists pgque.delayed_event (
    de_queue  integer not null,
    de_due    timestamptz not null,
    ev_id     bigint not null,
    ev_time   timestamptz not null,
    ev_txid   xid8 not null default pg_catalog.pg_current_xact_id(),
    ev_type   text,
    ev_data   text,
    ev_extra1 text,
    de_part   smallint not null  -- the partition (pgque.rotation 'delayed')
) partition by list (de_part);
create table if not exists pgque.delayed_event_0 partition of pgque.delayed_event
    for values in (0);
create table if not exists pgque.delayed_event_1 partition of pgque.delayed_event
    for values in (1);
-- The tick's move reads the rows falling due since the last tick ...
create index if not exists delayed_event_due on pgque.delayed_event (de_queue, de_due);
-- ... and those sent by transactions the last tick did not see.
create index if not exists delayed_event_txid on pgque.delayed_event (de_queue, ev_txid);

-- The idempotency keys: the first send of a key in a queue, with the event id
-- it returned. Only INSERTed, except that a key sent again after its window
-- replaces its expired row in place (an UPDATE: the one dead row here, one
-- per such reuse until the partition is emptied).
create table if not exists pgque.idempotency_key (
    ik_queue integer not null,
    ik_key   text not null,
    ik_event bigint not null,
    ik_time  timestamptz not null,
    ik_due   timestamptz,  -- the event's due time when it was sent delayed
    ik_part  smallint not null,  -- the partition (pgque.rotation 'idempotency')
    primary key (ik_queue, ik_key, ik_part)
) partition by list (ik_part);
create table if not exists pgque.idempotency_key_0 partition of pgque.idempotency_key
    for values in (0);
create table if not exists pgque.idempotency_key_1 partition of pgque.idempotency_key
    for values in (1);

-- The rotation's names gain 'delayed' and 'idempotency' (as in 0008: never
-- narrowed by a run again).
do $names$
begin
    if not exists (select from pg_catalog.pg_constraint
                    where conname = 'rotation_rt_name_check'
                      and conrelid = 'pgque.rotation'::pg_catalog.regclass
                      and pg_catalog.pg_get_constraintdef(oid) like '%''idempotency''%') then
        alter table pgque.rotation drop constraint if exists rotation_rt_name_check;
        alter table pgque.rotation add constraint rotation_rt_name_check
            check (rt_name in ('cursor', 'tick', 'nack', 'retry', 'held', 'delayed',
                               'idempotency'));
    end if;
end
$names$;
insert into pgque.rotation (rt_name) values ('delayed'), ('idempotency') on conflict do nothing;
