-- pgque: schema, roles and tables.
--
-- Everything lives in schema pgque. Event rows live in per-queue tables that
-- create_queue() makes (pgque.event_<queue_id> and its children
-- pgque.event_<queue_id>_<n>); the tables below hold the metadata around them.
-- Every statement here is idempotent: running the install twice changes nothing.

-- The install runs with search_path pinned to pg_catalog, pg_temp (the first
-- statement of the script and of the Python installer), so nothing here can
-- call a function or operator another role planted in public.

-- Refuse (PQ013) a schema pgque, or an object in it, owned by another role
-- than the installer: CREATE ... IF NOT EXISTS would use the squatter's schema,
-- CREATE OR REPLACE would keep the squatter the owner of what it replaces, and
-- the SECURITY DEFINER functions would run the squatter's code as the
-- installer. Checked before anything is created.
do $owner$
declare
    v_schema oid := (select n.oid from pg_catalog.pg_namespace n where n.nspname = 'pgque');
    v_other text;
begin
    if v_schema is null then
        return;
    end if;
    select pg_catalog.format('%s %s owned by %s', o.kind, o.name, o.owner::regrole)
      into v_other
      from (select 'schema' as kind, 'pgque' as name, n.nspowner as owner
              from pg_catalog.pg_namespace n where n.oid = v_schema
            union all
            select 'relation', c.relname::text, c.relowner
              from pg_catalog.pg_class c where c.relnamespace = v_schema
            union all
            select 'routine', p.oid::regprocedure::text, p.proowner
              from pg_catalog.pg_proc p where p.pronamespace = v_schema
            union all
            select 'type', t.typname::text, t.typowner
              from pg_catalog.pg_type t where t.typnamespace = v_schema
            union all
            select 'operator', o.oid::regoperator::text, o.oprowner
              from pg_catalog.pg_operator o where o.oprnamespace = v_schema
            union all
            select 'collation', c.collname::text, c.collowner
              from pg_catalog.pg_collation c where c.collnamespace = v_schema
            union all
            select 'conversion', c.conname::text, c.conowner
              from pg_catalog.pg_conversion c where c.connamespace = v_schema
            union all
            select 'operator class', c.opcname::text, c.opcowner
              from pg_catalog.pg_opclass c where c.opcnamespace = v_schema
            union all
            select 'operator family', f.opfname::text, f.opfowner
              from pg_catalog.pg_opfamily f where f.opfnamespace = v_schema
            union all
            select 'statistics object', s.stxname::text, s.stxowner
              from pg_catalog.pg_statistic_ext s where s.stxnamespace = v_schema
            union all
            select 'text search configuration', c.cfgname::text, c.cfgowner
              from pg_catalog.pg_ts_config c where c.cfgnamespace = v_schema
            union all
            select 'text search dictionary', d.dictname::text, d.dictowner
              from pg_catalog.pg_ts_dict d where d.dictnamespace = v_schema) o
     where o.owner <> (select r.oid from pg_catalog.pg_roles r where r.rolname = current_user)
     order by o.kind <> 'schema', o.name
     limit 1;
    if v_other is not null then
        raise exception using
            errcode = 'PQ013',
            message = pg_catalog.format('pgque cannot be installed by %s: %s',
                                        current_user, v_other),
            hint = 'Everything in schema pgque must belong to the role that installs it. '
                   'Install as that role, or drop or reassign what another role owns there.';
    end if;
end
$owner$;

create schema if not exists pgque;

-- The install lock: concurrent installers serialize on the one row of
-- pgque.install_lock, taken FOR UPDATE before anything that writes a catalog
-- row. Two transactions updating the same catalog row (REVOKE and GRANT
-- rewrite the schema's ACL, CREATE OR REPLACE FUNCTION its pg_proc row) do not
-- wait for each other: one fails with "tuple concurrently updated". Up to the
-- lock, this script only reads, or creates what does not exist yet: on an
-- existing install it writes no catalog row and locks nothing else of pgque
-- (CREATE ... IF NOT EXISTS of an existing table would lock the schema, and
-- so deadlock with an uninstall waiting for this install). Installers of an
-- empty database may race on CREATE SCHEMA and CREATE TABLE; the losers fail
-- with a unique violation once the winner commits, and pgque.schema.install()
-- runs the whole transaction again. uninstall() locks this table exclusively
-- before it drops the schema: it waits for running installs, and installs
-- wait for it. A lock on pgque's own table rather than an advisory lock: an
-- advisory key is a constant any role that can connect may take first and
-- hold, while this table is reachable only by the installer (schema pgque has
-- no USAGE for PUBLIC, and no role is granted anything on this table).
do $install_lock$
begin
    if pg_catalog.to_regclass('pgque.install_lock') is null then
        create table pgque.install_lock (
            il_singleton boolean primary key default true check (il_singleton)
        );
    end if;
    perform from pgque.install_lock for update;
    if not found then
        insert into pgque.install_lock default values on conflict do nothing;
        perform from pgque.install_lock for update;
    end if;
end
$install_lock$;

revoke all on schema pgque from public;

-- Roles are cluster-wide. Create them when the installer may; otherwise the
-- grants at the end of the install apply to whichever of them already exist.
do $roles$
declare
    v_role text;
    v_can_create boolean := (select rolsuper or rolcreaterole
                               from pg_catalog.pg_roles where rolname = current_user);
begin
    foreach v_role in array array['pgque_reader', 'pgque_writer', 'pgque_admin'] loop
        if not exists (select 1 from pg_catalog.pg_roles where rolname = v_role) then
            if v_can_create then
                execute pg_catalog.format('create role %I nologin', v_role);
            else
                raise notice 'pgque: role % does not exist and % may not create it; skipping its grants',
                    v_role, current_user;
            end if;
        end if;
    end loop;
end
$roles$;

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
    queue_created            timestamptz not null default now(),
    queue_senders            oid[],   -- roles granted 'send' (null: every pgque_writer)
    queue_consumers          oid[]    -- roles granted 'consume' (null: every pgque_reader)
);

-- The per-queue locks, one row per queue and purpose, taken FOR UPDATE:
--   tick   serializes the ticks of a queue (pgque._make_tick); the ticker
--          takes it SKIP LOCKED and passes over a queue being ticked or
--          dropped elsewhere;
--   maint  serializes the maintenance of a queue; a second maint() caller
--          takes it SKIP LOCKED and skips the queue.
-- drop_queue takes both, tick first, then the queue row: the order everyone
-- follows. Rows, not advisory locks: an advisory key is a constant any role
-- that can connect may hold forever, while these rows are reachable only
-- through pgque's SECURITY DEFINER functions. create_queue inserts them; the
-- insert below gives them to queues made before this table existed. Taking
-- one assigns a transaction id and writes WAL, so the ticker and maintenance
-- first look, without any lock, whether there is anything to do.
create table if not exists pgque.queue_lock (
    ql_queue   integer not null references pgque.queue on delete cascade,
    ql_purpose text not null check (ql_purpose in ('tick', 'maint')),
    primary key (ql_queue, ql_purpose)
);
insert into pgque.queue_lock (ql_queue, ql_purpose)
select q.queue_id, p.purpose
  from pgque.queue q cross join (values ('tick'), ('maint')) p (purpose)
on conflict do nothing;

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

-- A subscription is a consumer's identity on a queue. Its row changes only
-- when access to it is granted or its lock key is renewed (both rare): receive
-- and ack take it FOR UPDATE as the receive lock, which writes no new row
-- version. A plain consumer belongs to the role that subscribed it (sub_owner,
-- null for subscriptions made before 0.2, which every reader may use); a slot
-- subscription belongs to its consumer group and carries the key of the
-- session advisory lock that owns the slot (see 65_partition.sql).
create table if not exists pgque.subscription (
    sub_id       integer generated always as identity primary key,
    sub_queue    integer not null references pgque.queue on delete cascade,
    sub_consumer text not null,
    sub_created  timestamptz not null default now(),
    sub_owner    oid,
    sub_grantees oid[],     -- roles the owner or an admin granted access to
    sub_lock_key bigint,    -- slot subscriptions only
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
create index if not exists dead_letter_queue_idx on pgque.dead_letter (dl_queue, dl_consumer, dl_id);

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

-- The key of the session advisory lock that elects the active ticker: random
-- per install (and renewed when a role outside pgque sits on it), so a role
-- without pgque rights cannot know it in advance. One row.
create table if not exists pgque.ticker_election (
    te_single boolean primary key default true check (te_single),
    te_key    bigint not null
);

-- Installs made before 0.2 lack these columns (issue 10 brings numbered migrations).
alter table pgque.queue add column if not exists queue_senders oid[];
alter table pgque.queue add column if not exists queue_consumers oid[];
alter table pgque.subscription add column if not exists sub_owner oid;
alter table pgque.subscription add column if not exists sub_grantees oid[];
alter table pgque.subscription add column if not exists sub_lock_key bigint;
-- The subscription a dead letter came from (no foreign key: dead letters outlive
-- it). Who may read a dead letter follows that subscription, not its name, which
-- another role may subscribe once the consumer is gone; null (a consumer gone
-- before 0.2): admins only.
-- Filled from the names once, when the column is added: never again, or a
-- dead letter of a consumer gone since would go to a later one of its name.
do $dl_sub$
begin
    if not exists (select 1 from pg_catalog.pg_attribute
                    where attrelid = 'pgque.dead_letter'::regclass and attname = 'dl_sub'
                      and not attisdropped) then
        alter table pgque.dead_letter add column dl_sub integer;
        update pgque.dead_letter d set dl_sub = s.sub_id
          from pgque.subscription s
         where s.sub_queue = d.dl_queue and s.sub_consumer = d.dl_consumer;
    end if;
end
$dl_sub$;
