-- Migration 1 (pgque 0.1.0): the tables.
--
-- Everything lives in schema pgque. Event rows live in per-queue tables that
-- create_queue() makes (pgque.event_<queue_id> and its children
-- pgque.event_<queue_id>_<n>); the tables below hold the metadata around them.
-- Migrations run once each, in order: later ones change these tables.
--
-- Contract: this migration also converges the catalog of a 0.1.0 install, which
-- predates pgque.migration and so has no record of it (see guard.sql). Two
-- commits called themselves 0.1.0: 3bd2224 made every table below except
-- pgque.batch_nack, 09e6af5 made them all, each exactly as written here. So
-- every statement creates its object only when missing (IF NOT EXISTS), in the
-- install's transaction, and nothing here alters or drops anything: run over
-- either 0.1.0 it adds what that one lacks and keeps every row; run over an
-- empty schema it makes everything. Change a table in a new migration, never
-- here.

-- One row per queue, with its configuration and rotation state.
create table if not exists pgque.queue (
    queue_id                 integer generated always as identity primary key,
    queue_name               text not null unique,
    queue_event_seq          regclass not null,
    queue_ntables            integer not null default 3,
    queue_cur_table          integer not null default 0,
    queue_rotation_period    interval not null default '2 hours',
    queue_switch_time        timestamptz not null default now(),
    queue_ticker_max_count   integer not null default 500,
    queue_ticker_max_lag     interval not null default '0',
    queue_ticker_idle_period interval not null default '1 minute',
    queue_max_retries        integer not null default 5,
    queue_created            timestamptz not null default now()
);

-- A tick records a snapshot of the database: the events of a batch are those
-- committed as of one tick's snapshot and not as of the previous one.
create table if not exists pgque.tick (
    tick_queue     integer not null references pgque.queue on delete cascade,
    tick_id        bigint not null,
    tick_time      timestamptz not null default now(),
    tick_snapshot  pg_snapshot not null,
    tick_event_seq bigint not null,
    primary key (tick_queue, tick_id)
);

create sequence if not exists pgque.tick_id_seq;
create sequence if not exists pgque.batch_id_seq;

-- A subscription is a consumer's identity on a queue. Its row never changes
-- after insert: receive and ack take it FOR UPDATE as the receive lock, which
-- writes no new row version.
create table if not exists pgque.subscription (
    sub_id       integer generated always as identity primary key,
    sub_queue    integer not null references pgque.queue on delete cascade,
    sub_consumer text not null,
    sub_created  timestamptz not null default now(),
    unique (sub_queue, sub_consumer)
);

-- A subscription's cursor, kept as an append-only log: opening or handing out
-- a piece of a batch and acking insert the new state, and the current state
-- is the row with the highest cur_seq, found by reading the primary key
-- backwards. Nothing here is ever updated: an updated row would grow a chain
-- of versions that every later lookup walks, and a transaction holding back
-- the xmin horizon for minutes would make that chain, and every receive,
-- longer and longer. Maintenance deletes superseded rows in bulk.
create table if not exists pgque.cursor (
    cur_sub       integer not null,
    cur_seq       bigint not null,
    cur_last_tick bigint not null,   -- last tick whose batch is finished
    cur_batch     bigint,            -- id of the open batch, null when none
    cur_next_tick bigint,            -- tick that closes the open batch
    cur_pos       bigint,            -- highest ev_id acked inside the open batch
    cur_handed    bigint,            -- highest ev_id handed out by the latest receive
    cur_end       bigint,            -- highest ev_id of the open batch, once a receive saw its end (0: none)
    cur_time      timestamptz not null default now(),
    primary key (cur_sub, cur_seq)
);

-- Nacked events wait here until their retry time; maintenance moves them back
-- into the log, visible only to the subscription that nacked them.
create table if not exists pgque.retry_queue (
    ev_retry_after timestamptz not null,
    ev_queue       integer not null,
    ev_owner       integer not null references pgque.subscription on delete cascade,
    ev_id          bigint not null,
    ev_time        timestamptz not null,
    ev_retry       integer not null,
    ev_type        text,
    ev_data        text,
    ev_extra1      text,
    ev_extra2      text,
    ev_extra3      text,
    ev_extra4      text
);
create index if not exists retry_queue_due_idx on pgque.retry_queue (ev_queue, ev_retry_after);
create index if not exists retry_queue_owner_idx on pgque.retry_queue (ev_owner);

-- The events nacked inside a subscription's open batch, one row per event.
-- A consumer that nacks, dies before its ack and nacks the same event again
-- in the same (still open) batch hits this key and changes nothing: one
-- failure is one retry, and at most one dead letter, however often it is
-- repeated. Maintenance deletes the rows of finished batches.
create table if not exists pgque.batch_nack (
    bn_sub   integer not null references pgque.subscription on delete cascade,
    bn_batch bigint not null,
    bn_ev_id bigint not null,
    primary key (bn_sub, bn_batch, bn_ev_id)
);

-- Events that failed more often than the queue allows, with the reason.
create table if not exists pgque.dead_letter (
    dl_id       bigint generated always as identity primary key,
    dl_queue    integer not null references pgque.queue on delete cascade,
    dl_consumer text not null,
    dl_time     timestamptz not null default now(),
    dl_reason   text,
    ev_id       bigint not null,
    ev_time     timestamptz not null,
    ev_txid     xid8,
    ev_retry    integer not null,
    ev_type     text,
    ev_data     text,
    ev_extra1   text,
    ev_extra2   text,
    ev_extra3   text,
    ev_extra4   text
);
create index if not exists dead_letter_queue_idx
    on pgque.dead_letter (dl_queue, dl_consumer, dl_id);

-- The shape of an event row. Never holds rows: each queue's event tables are
-- made "like" it, and its row type is what receive() hands back.
create table if not exists pgque.event_template (
    ev_id     bigint not null,
    ev_time   timestamptz not null,
    ev_txid   xid8 not null,
    ev_owner  integer,
    ev_retry  integer not null default 0,
    ev_type   text,
    ev_data   text,
    ev_extra1 text,
    ev_extra2 text,
    ev_extra3 text,
    ev_extra4 text
);

-- One row per consumer group: its persisted slot count.
create table if not exists pgque.consumer_group (
    cg_id       integer generated always as identity primary key,
    cg_queue    integer not null references pgque.queue on delete cascade,
    cg_consumer text not null,
    cg_slots    integer not null,
    cg_created  timestamptz not null default now(),
    unique (cg_queue, cg_consumer)
);
