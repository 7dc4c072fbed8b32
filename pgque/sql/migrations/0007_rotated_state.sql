-- Migration 7 (pgque 0.5.0): the engine's own state in rotating tables.
--
-- Until 0.5 every receive and ack appended a cursor row, every tick a tick
-- row, every nack a nack record and a retry row, that maintenance later
-- deleted: dead rows for vacuum, piling up while a long transaction held the
-- xmin horizon back. Now each of these tables is partitioned in two, written
-- one at a time (pgque.rotation names which), and the other one is emptied by
-- TRUNCATE, which leaves nothing for vacuum (see code/ticker/rotation.sql); a
-- retry moved back into the log is marked so by a row of pgque.retry_moved
-- instead of being deleted. The tables in place become the first partitions,
-- with every row they hold: nothing is copied, and the first rotation empties
-- the other half.

-- Which partition of each rotated table is written now (rt_part, of rt_parts),
-- and since when: the row changes once per rotation, nothing else writes it.
create table if not exists pgque.rotation (
    rt_name   text primary key check (rt_name in ('cursor', 'tick', 'nack', 'retry')),
    rt_part   smallint not null default 0,
    rt_parts  smallint not null default 2 check (rt_parts = 2),
    rt_period interval not null default '1 minute',
    rt_time   timestamptz not null default now(),
    rt_switch bigint not null default 0,  -- the cursor log's: its last switch's number;
                                          -- the nack records': the first batch id
                                          -- whose records go to rt_part
    rt_moving boolean not null default false,  -- the cursor log's: a switch not finished
    check (rt_part >= 0 and rt_part < rt_parts)
);
insert into pgque.rotation (rt_name) values ('cursor'), ('tick'), ('nack'), ('retry')
    on conflict do nothing;

-- Names the rows of the retry queue, for their marks in pgque.retry_moved.
create sequence if not exists pgque.retry_seq;

-- Numbers the switches of the cursor log, outside any transaction: a
-- snapshot older than the latest switch sees a smaller number in
-- pgque.rotation than the sequence's (see code/ticker/rotation.sql).
create sequence if not exists pgque.cursor_switch_seq;

-- Every table the conversion locks, locked first: the tables it converts,
-- and those their foreign keys reference (attaching a table drops its foreign
-- keys' triggers on the referenced table). Live workers of the code before read these tables in any
-- order, so the migration never waits while it holds one of them: each try
-- gives up after 50 ms (before the server's deadlock check, which might pick
-- the migration as the victim) and lets go of what it took; while it waits,
-- new readers queue behind it, so a try soon finds the tables free.
do $lock$
declare
    v_timeout  text := pg_catalog.current_setting('lock_timeout');
    v_deadline timestamptz := pg_catalog.clock_timestamp() + interval '2 minutes';
begin
    perform pg_catalog.set_config('lock_timeout', '50ms', true);
    loop
        begin
            lock table pgque.queue, pgque.subscription, pgque.cursor, pgque.tick,
                       pgque.batch_nack, pgque.retry_queue in access exclusive mode;
            exit;
        exception when lock_not_available then
            if pg_catalog.clock_timestamp() > v_deadline then
                raise;
            end if;
        end;
    end loop;
    perform pg_catalog.set_config('lock_timeout', v_timeout, true);
end
$lock$;

-- The cursor log: the table in place becomes partition 0. Its name goes with
-- it (and its row type, which only pgque's code uses; the code is created
-- again after the migrations); the partitioned table takes the name. Each
-- table is converted only while it is a plain one: the migration may run
-- again (a lost pgque.migration, see 0001), and then changes nothing.
do $cursor$
begin
    if (select c.relkind from pg_catalog.pg_class c
         where c.oid = 'pgque.cursor'::pg_catalog.regclass) = 'p' then
        return;
    end if;
    alter table pgque.cursor rename to cursor_0;
    alter table pgque.cursor_0 drop constraint cursor_pkey;
    alter table pgque.cursor_0 add column cur_part smallint not null default 0;
    alter table pgque.cursor_0 alter column cur_part drop default;
    alter table pgque.cursor_0
        add constraint cursor_0_pkey primary key (cur_part, cur_sub, cur_seq);
    create table pgque.cursor (
        cur_sub       integer not null,
        cur_seq       bigint not null,
        cur_last_tick bigint not null,
        cur_batch     bigint,
        cur_next_tick bigint,
        cur_pos       bigint,
        cur_handed    bigint,
        cur_end       bigint,
        cur_time      timestamptz not null default now(),
        cur_part      smallint not null,  -- the partition (pgque.rotation 'cursor')
        primary key (cur_part, cur_sub, cur_seq)
    ) partition by list (cur_part);
    alter table pgque.cursor attach partition pgque.cursor_0 for values in (0);
    create table pgque.cursor_1 partition of pgque.cursor for values in (1);
end
$cursor$;

-- The ticks, the same way.
do $tick$
begin
    if (select c.relkind from pg_catalog.pg_class c
         where c.oid = 'pgque.tick'::pg_catalog.regclass) = 'p' then
        return;
    end if;
    alter table pgque.tick rename to tick_0;
    alter table pgque.tick_0 drop constraint tick_pkey;
    alter table pgque.tick_0 add column tick_part smallint not null default 0;
    alter table pgque.tick_0 alter column tick_part drop default;
    alter table pgque.tick_0
        add constraint tick_0_pkey primary key (tick_queue, tick_id, tick_part);
    create table pgque.tick (
        tick_queue     integer not null references pgque.queue on delete cascade,
        tick_id        bigint not null,
        tick_time      timestamptz not null default now(),
        tick_snapshot  pg_snapshot not null,
        tick_event_seq bigint not null,
        tick_part      smallint not null,  -- the partition (pgque.rotation 'tick')
        primary key (tick_queue, tick_id, tick_part)
    ) partition by list (tick_part);
    alter table pgque.tick attach partition pgque.tick_0 for values in (0);
    create table pgque.tick_1 partition of pgque.tick for values in (1);
end
$tick$;

-- The nack records (one per event nacked in an open batch), the same way.
do $nack$
begin
    if (select c.relkind from pg_catalog.pg_class c
         where c.oid = 'pgque.batch_nack'::pg_catalog.regclass) = 'p' then
        return;
    end if;
    alter table pgque.batch_nack rename to batch_nack_0;
    alter table pgque.batch_nack_0 drop constraint batch_nack_pkey;
    alter table pgque.batch_nack_0 add column bn_part smallint not null default 0;
    alter table pgque.batch_nack_0 alter column bn_part drop default;
    alter table pgque.batch_nack_0
        add constraint batch_nack_0_pkey primary key (bn_sub, bn_batch, bn_ev_id, bn_part);
    create table pgque.batch_nack (
        bn_sub   integer not null references pgque.subscription on delete cascade,
        bn_batch bigint not null,
        bn_ev_id bigint not null,
        bn_part  smallint not null,  -- the partition (pgque.rotation 'nack')
        primary key (bn_sub, bn_batch, bn_ev_id, bn_part)
    ) partition by list (bn_part);
    alter table pgque.batch_nack attach partition pgque.batch_nack_0 for values in (0);
    create table pgque.batch_nack_1 partition of pgque.batch_nack for values in (1);
end
$nack$;

-- The retry queue, the same way; each row gets a number (rq_id) by which
-- pgque.retry_moved marks it moved.
do $retry$
begin
    if (select c.relkind from pg_catalog.pg_class c
         where c.oid = 'pgque.retry_queue'::pg_catalog.regclass) = 'p' then
        return;
    end if;
    alter table pgque.retry_queue rename to retry_queue_0;
    alter index pgque.retry_queue_due_idx rename to retry_queue_0_due_idx;
    alter index pgque.retry_queue_owner_idx rename to retry_queue_0_owner_idx;
    alter table pgque.retry_queue_0
        add column rq_id bigint not null default pg_catalog.nextval('pgque.retry_seq');
    alter table pgque.retry_queue_0 alter column rq_id drop default;
    alter table pgque.retry_queue_0 add column rq_part smallint not null default 0;
    alter table pgque.retry_queue_0 alter column rq_part drop default;
    alter table pgque.retry_queue_0
        add constraint retry_queue_0_pkey primary key (rq_id, rq_part);
    create table pgque.retry_queue (
        ev_retry_after timestamptz not null,
        ev_queue       integer not null,
        ev_owner       integer not null references pgque.subscription on delete cascade,
        ev_id          bigint not null,
        ev_time        timestamptz not null,
        ev_retry       integer not null,
        ev_type        text,
        ev_data        text,
        ev_extra1      text,
        rq_id          bigint not null default pg_catalog.nextval('pgque.retry_seq'),
        rq_part        smallint not null,  -- the partition (pgque.rotation 'retry')
        primary key (rq_id, rq_part)
    ) partition by list (rq_part);
    create index retry_queue_due_idx on pgque.retry_queue (ev_queue, ev_retry_after);
    create index retry_queue_owner_idx on pgque.retry_queue (ev_owner);
    alter table pgque.retry_queue attach partition pgque.retry_queue_0 for values in (0);
    create table pgque.retry_queue_1 partition of pgque.retry_queue for values in (1);
end
$retry$;

-- A retry moved back into the log: the row of pgque.retry_queue it was, in the
-- same partition, emptied with it.
create table if not exists pgque.retry_moved (
    rm_id   bigint not null,
    rm_part smallint not null,
    primary key (rm_id, rm_part)
) partition by list (rm_part);
create table if not exists pgque.retry_moved_0 partition of pgque.retry_moved
    for values in (0);
create table if not exists pgque.retry_moved_1 partition of pgque.retry_moved
    for values in (1);
