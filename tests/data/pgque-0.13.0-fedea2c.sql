set local search_path = pg_catalog, pg_temp;

-- ===== refuse to run outside one transaction =====
do $pgque_one_transaction$
begin
    if pg_catalog.current_setting('search_path') <> 'pg_catalog, pg_temp' then
        raise warning using
            message = 'the pgque install script must run in one transaction: '
                      'this session ends here, and nothing was installed',
            hint = 'Use psql --single-transaction (-1), or pgque install.';
        perform pg_catalog.pg_terminate_backend(pg_catalog.pg_backend_pid());
    end if;
end
$pgque_one_transaction$;

-- ===== guard.sql =====
-- pgque: the install's guard: who installs, one installer at a time, roles,
-- and the record of applied migrations.
--
-- The install is three steps, in one transaction: this guard; the migrations
-- (pgque/sql/migrations, each applied once, in order, and recorded in
-- pgque.migration); and the code (pgque/sql/code: every function, procedure
-- and view, dropped and created again on every run). Every statement here is
-- idempotent: running the install twice changes nothing.

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

-- One row per migration applied to this database: its number and name, and
-- the version of pgque that applied it. An install of 0.1.0 predates this
-- table, and gets it empty, like an empty database: so every migration runs
-- over it, the first included. Its tables are not taken for migration 1's:
-- two commits called themselves 0.1.0, and the first (3bd2224) lacks
-- pgque.batch_nack. Migration 1 creates only what is missing (see its header),
-- so over either 0.1.0 it adds what that one lacks and keeps the rest.
do $migrations$
begin
    if pg_catalog.to_regclass('pgque.migration') is null then
        create table pgque.migration (
            mig_number  integer primary key,
            mig_name    text not null,
            mig_package text not null,
            mig_applied timestamptz not null default pg_catalog.now()
        );
    end if;
end
$migrations$;

-- A database that the 0.2.0 which landed (2f0bb29) upgraded from 0.1.0 has
-- migration 1 recorded as applied by '0.1.0', though it never ran: that
-- release's guard took a 0.1.0's tables for migration 1's, and over 3bd2224
-- the database never got pgque.batch_nack (nack and maint() fail there with
-- UndefinedTable). Only that guard ever wrote such a row: migrations came with
-- 0.2.0, and every migration step records the version running it. So the row
-- is forgotten, and migration 1 runs again below and is recorded anew: it
-- creates only what is missing and alters nothing, so over migrations 2 to 5
-- (which drop or rename nothing of it) it adds what that 0.1.0 lacked and
-- changes nothing else. This rather than a new migration making
-- pgque.batch_nack: migration 1 is what those databases skipped, and it
-- converges whatever a 0.1.0 catalog lacks from the one definition of its
-- tables. It happens at most once, and before any migration after 5: every
-- pgque that has one has this step, and none writes such a row again.
delete from pgque.migration where mig_number = 1 and mig_package = '0.1.0';

-- The version of pgque installed before this run, for the installer to report
-- (read from this table, never by calling into schema pgque). 0.1.0 had no
-- such table: a pgque whose tables exist without it is 0.1.0. The end of the
-- script records the new version.
do $installed$
begin
    if pg_catalog.to_regclass('pgque.installed') is null then
        create table pgque.installed (
            in_single  boolean primary key default true check (in_single),
            in_version text not null
        );
        if pg_catalog.to_regclass('pgque.queue') is not null then
            insert into pgque.installed (in_version) values ('0.1.0');
        end if;
    end if;
    perform pg_catalog.set_config(
        'pgque.installed_before', coalesce((select in_version from pgque.installed), ''), true);
end
$installed$;

-- ===== refuse a database migrated or installed by a newer pgque =====
do $pgque_newer$
declare
    v_mine integer;
    v_by text;
    v_installed text := pg_catalog.current_setting('pgque.installed_before');
    v_numbers constant text := '^([0-9]+)[.]([0-9]+)[.]([0-9]+)';
begin
    select m.mig_number, m.mig_package into v_mine, v_by
      from pgque.migration m order by m.mig_number desc limit 1;
    if v_mine > 12 then
        raise exception using
            errcode = 'PQ018',
            message = pg_catalog.format(
                'this database has pgque migration %s (from pgque %s); pgque 0.13.0 '
                'knows migrations up to 12 only', v_mine, v_by),
            hint = 'Install with the newer pgque (or later); never downgrade.';
    end if;
    if coalesce(pg_catalog.regexp_match(v_installed, v_numbers)::integer[], '{0,0,0}')
       > coalesce(pg_catalog.regexp_match('0.13.0', v_numbers)::integer[], '{0,0,0}') then
        raise exception using
            errcode = 'PQ018',
            message = pg_catalog.format(
                'this database has pgque %s installed, newer than pgque 0.13.0',
                v_installed),
            hint = 'Install with the newer pgque (or later); never downgrade.';
    end if;
end
$pgque_newer$;

-- ===== migration 0001_initial =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 1) then
        execute $pgque_migration_0001$
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

$pgque_migration_0001$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (1, 'initial', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0002_access_and_locks =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 2) then
        execute $pgque_migration_0002$
-- Migration 2 (pgque 0.2.0): access between teams, and locks no role outside
-- pgque can take.
--
-- Random lock keys are drawn here with the expression of pgque._random_key(),
-- written out: migrations run before the code is created.

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
-- insert below gives them to the queues that exist. Taking one assigns a
-- transaction id and writes WAL, so the ticker and maintenance first look,
-- without any lock, whether there is anything to do.
create table if not exists pgque.queue_lock (
    ql_queue   integer not null references pgque.queue on delete cascade,
    ql_purpose text not null check (ql_purpose in ('tick', 'maint')),
    primary key (ql_queue, ql_purpose)
);
insert into pgque.queue_lock (ql_queue, ql_purpose)
select q.queue_id, p.purpose
  from pgque.queue q cross join (values ('tick'), ('maint')) p (purpose)
on conflict do nothing;

-- Queue grants (see code/base/access.sql): the roles granted 'send' and
-- 'consume'; null, as for every queue here, means no restriction.
alter table pgque.queue add column if not exists queue_senders oid[];
alter table pgque.queue add column if not exists queue_consumers oid[];

-- A plain consumer belongs to the role that subscribed it (sub_owner; null for
-- the subscriptions made before, which every reader may use, as then), with the
-- roles granted access to it. A slot subscription belongs to its consumer group
-- and carries the random key of the session advisory lock that owns the slot
-- (see code/slots/groups.sql); the subscription row changes only when access
-- is granted or that key is renewed, both rare.
alter table pgque.subscription add column if not exists sub_owner oid;
alter table pgque.subscription add column if not exists sub_grantees oid[];
alter table pgque.subscription add column if not exists sub_lock_key bigint;
update pgque.subscription
   set sub_lock_key = ('x' || encode(substr(sha256(uuid_send(gen_random_uuid())), 1, 8),
                                     'hex'))::bit(64)::bigint
 where sub_lock_key is null and position('#' in sub_consumer) > 0;

-- The same for consumer groups, whose membership lock has a random key too.
alter table pgque.consumer_group add column if not exists cg_owner oid;
alter table pgque.consumer_group add column if not exists cg_grantees oid[];
alter table pgque.consumer_group add column if not exists cg_lock_key bigint;
update pgque.consumer_group
   set cg_lock_key = ('x' || encode(substr(sha256(uuid_send(gen_random_uuid())), 1, 8),
                                    'hex'))::bit(64)::bigint
 where cg_lock_key is null;

-- The subscription a dead letter came from (no foreign key: dead letters
-- outlive it). Who may read a dead letter follows that subscription, not its
-- name, which another role may subscribe once the consumer is gone. Filled
-- from the names of the subscriptions that exist now; the dead letters of
-- consumers gone before stay null: admins only.
alter table pgque.dead_letter add column if not exists dl_sub integer;
update pgque.dead_letter d set dl_sub = s.sub_id
  from pgque.subscription s
 where d.dl_sub is null and s.sub_queue = d.dl_queue and s.sub_consumer = d.dl_consumer;

-- The key of the session advisory lock that elects the active ticker: random
-- per install (and renewed when a role outside pgque sits on it), so a role
-- without pgque rights cannot know it in advance. One row.
create table if not exists pgque.ticker_election (
    te_single boolean primary key default true check (te_single),
    te_key    bigint not null
);
insert into pgque.ticker_election (te_key)
values (('x' || encode(substr(sha256(uuid_send(gen_random_uuid())), 1, 8), 'hex'))::bit(64)::bigint)
on conflict do nothing;

$pgque_migration_0002$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (2, 'access_and_locks', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0003_drop_event_extras =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 3) then
        execute $pgque_migration_0003$
-- Migration 3 (pgque 0.2.0): events stop carrying ev_extra2..4.
--
-- They came with PgQ's event shape; no pgque function ever set them, so every
-- value in them is null and nothing is lost. ev_extra1 (the partition key)
-- stays. Dropping a column only marks it dropped in the catalog: no table is
-- rewritten. Each queue's event tables inherit their columns from the queue's
-- parent table (pgque.event_<queue_id>), so dropping them there drops them from
-- its children too. The parent's name is written out here: migrations run
-- before the code (and so pgque._event_table) is created.
alter table pgque.event_template
    drop column if exists ev_extra2, drop column if exists ev_extra3,
    drop column if exists ev_extra4;
alter table pgque.retry_queue
    drop column if exists ev_extra2, drop column if exists ev_extra3,
    drop column if exists ev_extra4;
alter table pgque.dead_letter
    drop column if exists ev_extra2, drop column if exists ev_extra3,
    drop column if exists ev_extra4;
do $drop_extras$
declare
    v_queue_id integer;
begin
    for v_queue_id in select queue_id from pgque.queue order by queue_id loop
        execute format('alter table pgque.%I drop column if exists ev_extra2, '
                       'drop column if exists ev_extra3, drop column if exists ev_extra4',
                       'event_' || v_queue_id::text);
    end loop;
end
$drop_extras$;

$pgque_migration_0003$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (3, 'drop_event_extras', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0004_slot_epochs =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 4) then
        execute $pgque_migration_0004$
-- Migration 4 (pgque 0.2.0): fencing epochs for slot owners (see
-- code/slots/fence.sql).
--
-- Epochs come from one sequence, so they only grow, across every slot and
-- every subscription a slot ever had. A slot gets its row on the first
-- receive of its first owner; the slots that exist have none yet.
create sequence if not exists pgque.epoch_seq;

-- One row per slot subscription that was ever received from: its current
-- epoch and the session that took it (the pid, and when that backend started,
-- since pids are reused). sc_pid is null once that session released the slot.
create table if not exists pgque.slot_claim (
    sc_sub           integer primary key references pgque.subscription on delete cascade,
    sc_epoch         bigint not null,
    sc_pid           integer,
    sc_backend_start timestamptz,
    sc_time          timestamptz not null default now()
);

$pgque_migration_0004$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (4, 'slot_epochs', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0005_dead_letter_by_subscription =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 5) then
        execute $pgque_migration_0005$
-- Migration 5 (pgque 0.2.0): dead letters are counted per subscription
-- (dl_sub, see 0002) by the info views: an index to count them by.
create index if not exists dead_letter_sub_idx on pgque.dead_letter (dl_sub);

$pgque_migration_0005$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (5, 'dead_letter_by_subscription', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0006_epoch_keys =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 6) then
        execute $pgque_migration_0006$
-- Migration 6 (pgque 0.3.0): a slot's epoch names the session that took it by
-- pid and an advisory lock that session holds, the epoch's key (see
-- code/slots/fence.sql), no longer by the backend's start time, which
-- pg_stat_activity hides from an installer without pg_read_all_stats. The
-- epochs in place stay; nobody holds their keys, so they fence nothing in
-- (check_fence refuses them) and every slot's next receive takes a new one.
alter table pgque.slot_claim drop column if exists sc_backend_start;

$pgque_migration_0006$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (6, 'epoch_keys', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0007_rotated_state =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 7) then
        execute $pgque_migration_0007$
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

$pgque_migration_0007$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (7, 'rotated_state', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0008_pause_policy =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 8) then
        execute $pgque_migration_0008$
-- Migration 8 (pgque 0.6.0): the pause failure policy.
--
-- A consumer group chooses what a failed event does to its key: 'skip' (the
-- event goes to the retry queue, the key moves on) or 'pause' (no later event
-- of the key is handed out until the failed one is handled or dead-lettered).
-- A paused key has one marker, pgque.blocked_key; the events of the key that
-- its slot reads while it is blocked are set aside, in order, in
-- pgque.held_event, and handed out from there once the key is released (see
-- code/slots/pause.sql). Existing groups keep 'skip'.

alter table pgque.consumer_group
    add column if not exists cg_policy text not null default 'skip',
    add column if not exists cg_max_attempts integer,
    add column if not exists cg_pause_timeout interval,
    add column if not exists cg_max_retries integer;  -- null: the queue's max_retries

do $policy$
begin
    if not exists (select from pg_catalog.pg_constraint
                    where conname = 'consumer_group_policy_check'
                      and conrelid = 'pgque.consumer_group'::pg_catalog.regclass) then
        alter table pgque.consumer_group add constraint consumer_group_policy_check
            check (cg_policy in ('skip', 'pause')
                   and (cg_max_attempts is null or cg_max_attempts >= 1)
                   and (cg_pause_timeout is null or cg_pause_timeout > interval '0')
                   and (cg_max_retries is null or cg_max_retries >= 0));
    end if;
end
$policy$;

-- One row per blocked key of a slot subscription. Written when the key's
-- event fails, at each later failure of its head, when a piece of its held
-- events is handed out and acked, and by the ledger's verbs; deleted once its
-- held events are all handled. Nothing here is written for a key that is not
-- blocked.
create table if not exists pgque.blocked_key (
    bk_sub          integer not null references pgque.subscription on delete cascade,
    bk_key          text not null,
    -- The slot's own reads hold the key's events after this point of its log:
    -- in a later batch, or in this batch after this event.
    bk_from_batch   bigint not null,
    bk_from_ev      bigint not null,
    -- The held events of the key with he_seq above this are still to be
    -- handled; the first of them is the head, the one that failed.
    bk_done_seq     bigint not null,
    bk_attempts     integer not null,      -- how often the head failed
    bk_retry_at     timestamptz not null,  -- when the head may be handed out again
    bk_since        timestamptz not null,  -- when the head first failed
    bk_first_error  text,
    bk_last_error   text,
    bk_last_failure timestamptz,
    -- The piece of held events handed out and not acked yet: its batch id and
    -- the he_seq of its last event of this key.
    bk_batch        bigint,
    bk_handed_seq   bigint,
    bk_epoch        bigint,  -- the slot owner's epoch it was handed out under
    primary key (bk_sub, bk_key)
);
create index if not exists blocked_key_ready on pgque.blocked_key (bk_sub, bk_retry_at);
create index if not exists blocked_key_piece on pgque.blocked_key (bk_batch)
    where bk_batch is not null;

-- Orders the held events.
create sequence if not exists pgque.held_seq;

-- The held events: an event of a blocked key, set aside in order (he_seq) as
-- it was read, its retry count as it was. Never updated or deleted: a row is
-- done once its marker's bk_done_seq passed it or the marker is gone, and
-- the table rotates like the retry queue (two partitions, the one not written
-- emptied by TRUNCATE after what is still needed in it is copied over).
--
-- No foreign key to pgque.subscription: its check would share-lock the
-- subscription's row, which a worker holds (its receive lock) while it reads
-- this table, and the rotation's copy would wait for it while holding the
-- partition it empties (a deadlock). The rows of a subscription that is gone
-- have no marker, so the next rotation leaves them behind.
create table if not exists pgque.held_event (
    he_sub   integer not null,
    he_key   text not null,
    he_seq   bigint not null,
    he_batch bigint not null,  -- the batch of the slot's log it was read from
    ev_id    bigint not null,
    ev_time  timestamptz not null,
    ev_txid  xid8,
    ev_retry integer not null,
    ev_type  text,
    ev_data  text,
    he_part  smallint not null,  -- the partition (pgque.rotation 'held')
    primary key (he_sub, he_key, he_seq, he_part)
) partition by list (he_part);
create table if not exists pgque.held_event_0 partition of pgque.held_event for values in (0);
create table if not exists pgque.held_event_1 partition of pgque.held_event for values in (1);
-- A piece of the log handed out again sets aside only what it did not the first time.
create index if not exists held_event_read on pgque.held_event (he_sub, he_batch, ev_id);

-- The rotation's names gain 'held', unless they have it already: a run again
-- (a lost pgque.migration, see 0001) after a later migration added more
-- names must not narrow them.
do $names$
begin
    if not exists (select from pg_catalog.pg_constraint
                    where conname = 'rotation_rt_name_check'
                      and conrelid = 'pgque.rotation'::pg_catalog.regclass
                      and pg_catalog.pg_get_constraintdef(oid) like '%''held''%') then
        alter table pgque.rotation drop constraint if exists rotation_rt_name_check;
        alter table pgque.rotation add constraint rotation_rt_name_check
            check (rt_name in ('cursor', 'tick', 'nack', 'retry', 'held'));
    end if;
end
$names$;
insert into pgque.rotation (rt_name) values ('held') on conflict do nothing;

$pgque_migration_0008$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (8, 'pause_policy', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0009_delayed_and_idempotent_sends =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 9) then
        execute $pgque_migration_0009$
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

$pgque_migration_0009$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (9, 'delayed_and_idempotent_sends', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0010_ticker_sleep =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 10) then
        execute $pgque_migration_0010$
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

$pgque_migration_0010$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (10, 'ticker_sleep', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0011_poll_state =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 11) then
        execute $pgque_migration_0011$
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

$pgque_migration_0011$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (11, 'poll_state', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== migration 0012_handling_record =====
do $pgque_migrate$
begin
    if not exists (select 1 from pgque.migration where mig_number = 12) then
        execute $pgque_migration_0012$
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

$pgque_migration_0012$;
        insert into pgque.migration (mig_number, mig_name, mig_package)
        values (12, 'handling_record', '0.13.0');
    end if;
end
$pgque_migrate$;

-- ===== install/drop_code.sql =====
-- pgque: drop the stateless part before recreating it.
--
-- Tables hold the state; everything else (functions, procedures, views,
-- composite types) is code, dropped here and created again by the files that
-- follow, on every install and upgrade, generated code included (written again
-- by install/generated.sql). So an upgraded install has exactly a fresh install's
-- code: a routine whose signature changed or that is gone leaves nothing
-- behind. EXECUTE grants go with the routines and install/grants.sql makes them
-- again (grant pgque's roles, not its functions, to keep yours).
--
-- Objects of yours that depend on pgque's code (a view over
-- pgque.consumer_info, a function returning its row type) would go with it:
-- the install refuses (PQ017) and names them instead.
--
-- First the generators' lock (code/generated/generator.sql), held to the
-- install's commit: a generator that is writing its code now finishes first;
-- one that comes later finds the lock taken and leaves its code to the next
-- maintenance pass. Nothing else is locked here, so maintenance goes on while
-- the install waits for a session that reads a view it drops.

lock table pgque.install_lock in share update exclusive mode;

do $code$
declare
    v_schema oid := 'pgque'::regnamespace;
    v_outside text;
    v_object text;
    v_messages text := pg_catalog.current_setting('client_min_messages');
begin
    select string_agg(distinct pg_catalog.format('%s %s', i.type, i.identity), ', ')
      into v_outside
      from pg_catalog.pg_depend d
     cross join lateral pg_catalog.pg_identify_object(d.classid, d.objid, d.objsubid) i
     where d.deptype = 'n'
       and ((d.refclassid = 'pg_catalog.pg_proc'::pg_catalog.regclass
             and d.refobjid in (select p.oid from pg_catalog.pg_proc p
                                 where p.pronamespace = v_schema))
            or (d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
                and d.refobjid in (select c.oid from pg_catalog.pg_class c
                                    where c.relnamespace = v_schema and c.relkind = 'v'))
            -- The row types of views and composite types, and their array
            -- types (a column of pgque.batch_event[] depends on the array).
            or (d.refclassid = 'pg_catalog.pg_type'::pg_catalog.regclass
                and d.refobjid in (select t.oid from pg_catalog.pg_type t
                                     join pg_catalog.pg_class c
                                       on t.oid in (c.reltype, (select a.typarray
                                                                  from pg_catalog.pg_type a
                                                                 where a.oid = c.reltype))
                                    where c.relnamespace = v_schema and c.relkind in ('v', 'c'))))
       -- The schema of the dependent object; a view's rule, a default, a
       -- trigger have none of their own: their table's.
       and case d.classid
               when 'pg_catalog.pg_rewrite'::pg_catalog.regclass then
                   (select c.relnamespace from pg_catalog.pg_rewrite r
                      join pg_catalog.pg_class c on c.oid = r.ev_class where r.oid = d.objid)
               when 'pg_catalog.pg_attrdef'::pg_catalog.regclass then
                   (select c.relnamespace from pg_catalog.pg_attrdef a
                      join pg_catalog.pg_class c on c.oid = a.adrelid where a.oid = d.objid)
               when 'pg_catalog.pg_trigger'::pg_catalog.regclass then
                   (select c.relnamespace from pg_catalog.pg_trigger t
                      join pg_catalog.pg_class c on c.oid = t.tgrelid where t.oid = d.objid)
               when 'pg_catalog.pg_constraint'::pg_catalog.regclass then
                   (select c.connamespace from pg_catalog.pg_constraint c where c.oid = d.objid)
               else (select n.oid from pg_catalog.pg_namespace n where n.nspname = i.schema)
           end is distinct from v_schema;
    if v_outside is not null then
        raise exception using
            errcode = 'PQ017',
            message = pg_catalog.format('pgque cannot replace its views and functions: %s '
                                        'depends on them', v_outside),
            hint = 'Drop those objects, run the install, and create them again.';
    end if;

    -- Quietly: each drop cascades to pgque's own dependent code, and says so.
    perform pg_catalog.set_config('client_min_messages', 'warning', true);
    -- By name from the catalog row, not regclass: a view an earlier drop
    -- cascaded to is gone from the catalog cache, and regclass would print its
    -- number (the loop reads its rows in batches, some after such drops).
    for v_object in
        select pg_catalog.format('pgque.%I', c.relname) from pg_catalog.pg_class c
         where c.relnamespace = v_schema and c.relkind = 'v' loop
        execute pg_catalog.format('drop view if exists %s cascade', v_object);
    end loop;
    for v_object in
        select p.oid::pg_catalog.regprocedure::text from pg_catalog.pg_proc p
         where p.pronamespace = v_schema loop
        -- A routine dropped by an earlier cascade is gone from the catalog by now.
        if pg_catalog.to_regprocedure(v_object) is not null then
            execute pg_catalog.format('drop routine %s cascade', v_object);
        end if;
    end loop;
    for v_object in
        select pg_catalog.format('pgque.%I', c.relname) from pg_catalog.pg_class c
         where c.relnamespace = v_schema and c.relkind = 'c' loop
        execute pg_catalog.format('drop type if exists %s cascade', v_object);
    end loop;
    perform pg_catalog.set_config('client_min_messages', v_messages, true);
end
$code$;

set local check_function_bodies = off;

-- ===== code/base/access.sql =====
-- pgque: who may use which queue and which consumer.
--
-- The roles set the outer bound (pgque_writer sends, pgque_reader consumes,
-- pgque_admin does everything; see install/grants.sql). Inside it, two narrower
-- rules let several teams share one database:
--
--   * A consumer (a plain subscription or a consumer group) belongs to the
--     role that subscribed it. Receiving, acking, nacking, claiming its
--     slots, listing, replaying and purging its dead letters and
--     unsubscribing it are refused (PQ014) to every other role, except
--     admins and the roles its owner granted access to (grant_consumer).
--     Dead letters of a consumer that was unsubscribed are the admins' alone
--     (see consumers/dead_letters.sql).
--   * A queue may be restricted: once a role is granted 'send' on it
--     (grant_queue), only the granted roles may send to it; once one is
--     granted 'consume', only those may subscribe to it and consume from it
--     (PQ015 for the others). A queue without grants of a kind keeps the
--     role-wide rule, so single-team databases change nothing.
--
-- "Role R may" always means R or a role R is a member of (pg_has_role with
-- MEMBER). Admins are members of pgque_admin, superusers, and the role that
-- installed pgque. The caller is the role of the session (its SET ROLE, else
-- its login role): inside a SECURITY DEFINER function current_user is the
-- installer, so these functions read the session's role setting instead. A
-- caller that reaches pgque through a SECURITY DEFINER function of its own is
-- therefore judged as the session's role, not as that function's owner.
--
-- Errors (see pgque/errors.py): PQ014, PQ015, PQ016.

-- pgque._caller(): the name of the role the session acts as.
create or replace function pgque._caller()
returns name
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (case when current_setting('role') = 'none' then session_user
                    else current_setting('role')::name end);
end
$$;

-- pgque._is_admin(role): whether role may do everything: a member of
-- pgque_admin or of the installer (current_user here, since only SECURITY
-- DEFINER functions call this), or a superuser.
create or replace function pgque._is_admin(p_role name)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (pg_has_role(p_role, current_user, 'member')
            or coalesce(pg_has_role(p_role, to_regrole('pgque_admin'), 'member'), false));
end
$$;

-- pgque._is_admin_id(role_oid): _is_admin for a role given by oid (another
-- session's login role, as pg_stat_activity shows it).
create or replace function pgque._is_admin_id(p_role oid)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (pg_has_role(p_role, current_user::regrole::oid, 'member')
            or coalesce(pg_has_role(p_role, to_regrole('pgque_admin'), 'member'), false));
end
$$;

-- pgque._in_roles(role, roles): whether role is a member of one of roles
-- (oids; ones dropped since simply match nobody).
create or replace function pgque._in_roles(p_role oid, p_roles oid[])
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select exists (select 1 from unnest(p_roles) g where pg_has_role(p_role, g, 'member')));
end
$$;

-- pgque._role_id(name): the oid of a role by name (the name exactly as
-- stored, not an identifier to parse).
create or replace function pgque._role_id(p_role name)
returns oid
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select oid from pg_roles where rolname = p_role);
end
$$;

-- pgque._may_execute(role, routine): whether role (an oid) or a role it is a
-- member of may execute routine. Membership, not inherited privilege: a login
-- created NOINHERIT that acts through SET ROLE team may do what team may.
create or replace function pgque._may_execute(p_role oid, p_routine regprocedure)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (p_role is not null and p_routine is not null
           and (has_function_privilege(p_role, p_routine, 'execute')
                or exists (select 1 from pg_proc p
                            cross join lateral aclexplode(coalesce(p.proacl,
                                                                   acldefault('f', p.proowner))) a
                            where p.oid = p_routine and a.privilege_type = 'EXECUTE'
                              and (a.grantee = 0 or pg_has_role(p_role, a.grantee, 'member')))));
end
$$;

-- pgque._may_consume(role, queue, owner, grantees): whether sessions of role
-- (an oid: another session's login role, as pg_stat_activity shows it) may
-- use a consumer of queue owned by owner with grantees: role, or a role it is
-- a member of, must be able to run receive_partitioned at all (a
-- pgque_reader, an admin or a role granted EXECUTE), pass the queue's
-- 'consume' grants, and own the consumer or have been granted it. An owner of
-- null (a consumer made before 0.2) lets every such role in. Used to tell
-- which sessions holding a slot's or group's lock count.
create or replace function pgque._may_consume(
    p_role oid, p_queue pgque.queue, p_owner oid, p_grantees oid[])
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (p_role is not null
           and pgque._may_execute(
                   p_role, to_regprocedure('pgque.receive_partitioned(text,text,integer,integer,integer)'))
           and (pgque._is_admin_id(p_role)
                or ((p_queue.queue_consumers is null
                     or pgque._in_roles(p_role, p_queue.queue_consumers))
                    and (p_owner is null or pg_has_role(p_role, p_owner, 'member')
                         or pgque._in_roles(p_role, p_grantees)))));
end
$$;

-- pgque._require_queue(queue, privilege): PQ015 unless the caller may send
-- to ('send') or consume from ('consume') the queue under its grants.
create or replace function pgque._require_queue(p_queue pgque.queue, p_privilege text)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_roles oid[] := case p_privilege when 'send' then p_queue.queue_senders
                                      else p_queue.queue_consumers end;
    v_caller name;
begin
    if v_roles is null then
        return;  -- no grants of this kind: the role-wide rule applies
    end if;
    v_caller := pgque._caller();
    if pgque._in_roles(pgque._role_id(v_caller), v_roles) or pgque._is_admin(v_caller) then
        return;
    end if;
    raise exception using errcode = 'PQ015',
        message = format('role %s may not %s queue %L', v_caller,
                         case p_privilege when 'send' then 'send to' else 'consume from' end,
                         p_queue.queue_name),
        hint = format('An admin grants it with pgque.grant_queue(%L, %L, %L).',
                      p_queue.queue_name, v_caller, p_privilege);
end
$$;

-- pgque._require_consumer(queue, owner, grantees, consumer): PQ014 unless the
-- caller may use consumer (a plain consumer or a consumer group) of queue:
-- it is an admin, or it passes the queue's 'consume' grants and owns the
-- consumer or was granted it. Cheap on the hot path when the caller is the
-- owner and the queue has no grants: no query is run.
create or replace function pgque._require_consumer(
    p_queue pgque.queue, p_owner oid, p_grantees oid[], p_consumer text)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_caller name;
begin
    if p_owner is not null then
        -- pgque._caller(), written out: this runs on every receive and ack.
        v_caller := case when current_setting('role') = 'none' then session_user
                         else current_setting('role')::name end;
        if not (pg_has_role(v_caller, p_owner, 'member')
                or pgque._in_roles(pgque._role_id(v_caller), p_grantees)
                or pgque._is_admin(v_caller)) then
            raise exception using errcode = 'PQ014',
                message = format('role %s may not use consumer %L of queue %L', v_caller,
                                 pgque._name_for_message(p_consumer), p_queue.queue_name),
                hint = format('It belongs to role %s; its owner or an admin may grant it with '
                              'pgque.grant_consumer(%L, %L, %L).', p_owner::regrole,
                              p_queue.queue_name, pgque._name_for_message(p_consumer), v_caller);
        end if;
    end if;
    if p_queue.queue_consumers is not null then
        perform pgque._require_queue(p_queue, 'consume');
    end if;
end
$$;

-- pgque._grant_role(role, granted): the oid of the role named in a grant or
-- revoke, compared as text (a name type would cut a long argument to 63 bytes
-- and match another role). To revoke from a role dropped since it was
-- granted, which queue_grants shows by its oid, that oid as text is accepted
-- when it is among granted and names no role. PQ016 otherwise.
create or replace function pgque._grant_role(p_role text, p_granted oid[] default null)
returns oid
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_oid oid := (select r.oid from pg_roles r where r.rolname::text = p_role);
begin
    if v_oid is null and p_role ~ '^[0-9]{1,10}$' and p_role::bigint <= 4294967295
       and p_role::bigint::oid = any(coalesce(p_granted, '{}'))
       and not exists (select 1 from pg_roles r where r.oid = p_role::bigint::oid) then
        v_oid := p_role::bigint::oid;
    end if;
    if v_oid is null then
        raise exception using errcode = 'PQ016',
            message = format('role %L does not exist', pgque._name_for_message(p_role));
    end if;
    return v_oid;
end
$$;

-- pgque._change_queue_grant(queue, role, privilege, add): adds role to (or
-- removes it from) the roles granted privilege ('send' or 'consume') on the
-- queue; returns whether that changed anything. An empty list becomes null:
-- no restriction. The queue row is locked first, so concurrent changes queue
-- up. PQ001 (unknown queue), PQ016 (unknown role or privilege; on revoke, a
-- dropped role may be named by the oid queue_grants shows).
create or replace function pgque._change_queue_grant(
    p_queue text, p_role text, p_privilege text, p_add boolean)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
    v_before oid[];
    v_role oid;
    v_after oid[];
begin
    if p_privilege is null or p_privilege not in ('send', 'consume') then
        raise exception using errcode = 'PQ016',
            message = format('privilege must be ''send'' or ''consume'', not %L',
                             pgque._name_for_message(p_privilege));
    end if;
    select * into v_queue from pgque.queue where queue_id = (pgque._queue_row(p_queue)).queue_id
       for no key update;
    v_before := case p_privilege when 'send' then v_queue.queue_senders
                                 else v_queue.queue_consumers end;
    v_role := pgque._grant_role(p_role, case when not p_add then v_before end);
    if (v_role = any(coalesce(v_before, '{}'))) = p_add then
        return false;  -- granted already, or not granted at all
    end if;
    v_after := case when p_add then coalesce(v_before, '{}') || v_role
                    else nullif(array_remove(v_before, v_role), '{}') end;
    if p_privilege = 'send' then
        update pgque.queue set queue_senders = v_after where queue_id = v_queue.queue_id;
    else
        update pgque.queue set queue_consumers = v_after where queue_id = v_queue.queue_id;
    end if;
    return true;
end
$$;

-- pgque.grant_queue(queue, role, privilege): restricts privilege ('send' or
-- 'consume') on the queue to the roles granted it, adding role; true when
-- role was not granted it yet. Admins only. Raises PQ001 (unknown queue),
-- PQ016 (unknown role or privilege).
create or replace function pgque.grant_queue(p_queue text, p_role text, p_privilege text)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._change_queue_grant(p_queue, p_role, p_privilege, true) $$;

-- pgque.revoke_queue(queue, role, privilege): takes privilege on the queue
-- back from role; true when role had it. When the last grant of a kind goes,
-- the queue is open again to every role of that kind (pgque_writer for
-- 'send', pgque_reader for 'consume'). Admins only.
create or replace function pgque.revoke_queue(p_queue text, p_role text, p_privilege text)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._change_queue_grant(p_queue, p_role, p_privilege, false) $$;

-- pgque.queue_grants(queue): the roles granted each privilege on the queue,
-- one row per (privilege, role); none when the queue is unrestricted.
create or replace function pgque.queue_grants(p_queue text)
returns table (privilege text, role_name text)
language sql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select g.privilege, coalesce(r.rolname::text, g.role::text)
      from pgque._queue_row(p_queue) q
     cross join lateral (select 'send' as privilege, unnest(q.queue_senders) as role
                         union all
                         select 'consume', unnest(q.queue_consumers)) g
      left join pg_roles r on r.oid = g.role
     order by 1, 2
$$;

-- pgque._change_consumer_grant(queue, consumer, role, add): adds role to (or
-- removes it from) the grantees of consumer: the plain consumer and the
-- consumer group of that name, those of them the caller owns (or all, for an
-- admin). Returns whether anything changed; PQ002 when there is no such
-- consumer, PQ014 when the caller owns none of them, PQ016 for an unknown
-- role (on revoke, a dropped role may be named by the oid queue grants show).
create or replace function pgque._change_consumer_grant(
    p_queue text, p_consumer text, p_role text, p_add boolean)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_caller name := pgque._caller();
    v_admin boolean := pgque._is_admin(v_caller);
    v_found boolean := false;
    v_subs integer[];
    v_groups integer[];
    v_granted oid[];
    v_role oid;
    v_changed integer;
    v_total integer := 0;
begin
    select coalesce(bool_or(true), false) or v_found,
           array_agg(s.sub_id) filter (where v_admin or pg_has_role(v_caller, s.sub_owner, 'member')),
           array_agg(g) filter (where v_admin or pg_has_role(v_caller, s.sub_owner, 'member'))
      into v_found, v_subs, v_granted
      from pgque.subscription s
      left join lateral unnest(s.sub_grantees) g on true
     where s.sub_queue = v_queue.queue_id and s.sub_consumer = p_consumer
       and position('#' in p_consumer) = 0 and s.sub_owner is not null;
    select coalesce(bool_or(true), false) or v_found,
           array_agg(c.cg_id) filter (where v_admin or pg_has_role(v_caller, c.cg_owner, 'member')),
           v_granted || array_agg(g) filter (where v_admin or pg_has_role(v_caller, c.cg_owner, 'member'))
      into v_found, v_groups, v_granted
      from pgque.consumer_group c
      left join lateral unnest(c.cg_grantees) g on true
     where c.cg_queue = v_queue.queue_id and c.cg_consumer = p_consumer
       and c.cg_owner is not null;
    v_role := pgque._grant_role(p_role, case when not p_add then v_granted end);
    if not v_found then
        raise exception using errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L (or has no owner)',
                             pgque._name_for_message(p_consumer), v_queue.queue_name);
    end if;
    if cardinality(v_subs) is null and cardinality(v_groups) is null then
        raise exception using errcode = 'PQ014',
            message = format('role %s may not grant consumer %L of queue %L', v_caller,
                             pgque._name_for_message(p_consumer), v_queue.queue_name),
            hint = 'Only the role that owns the consumer, or an admin, may grant or revoke it.';
    end if;
    update pgque.subscription
       set sub_grantees = case when p_add then coalesce(sub_grantees, '{}') || v_role
                               else nullif(array_remove(sub_grantees, v_role), '{}') end
     where sub_id = any(v_subs)
       and (v_role = any(coalesce(sub_grantees, '{}'))) <> p_add;
    get diagnostics v_changed = row_count;
    v_total := v_changed;
    update pgque.consumer_group
       set cg_grantees = case when p_add then coalesce(cg_grantees, '{}') || v_role
                              else nullif(array_remove(cg_grantees, v_role), '{}') end
     where cg_id = any(v_groups)
       and (v_role = any(coalesce(cg_grantees, '{}'))) <> p_add;
    get diagnostics v_changed = row_count;
    return v_total + v_changed > 0;
end
$$;

-- pgque.grant_consumer(queue, consumer, role): lets role (and its members)
-- use consumer (a plain consumer or a consumer group) as its owner does:
-- receive, ack, nack, claim slots, list, replay and purge its dead letters,
-- unsubscribe. True when role was not granted it yet. The owner or an admin
-- only.
create or replace function pgque.grant_consumer(p_queue text, p_consumer text, p_role text)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._change_consumer_grant(p_queue, p_consumer, p_role, true) $$;

-- pgque.revoke_consumer(queue, consumer, role): takes that access back; true
-- when role had it. A session of role that owns one of the group's slots
-- keeps its lock but is refused (PQ014) at its next call.
create or replace function pgque.revoke_consumer(p_queue text, p_consumer text, p_role text)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._change_consumer_grant(p_queue, p_consumer, p_role, false) $$;

-- ===== code/base/util.sql =====
-- pgque: small internal helpers shared by the rest of the engine.
--
-- Errors carry SQLSTATEs of class PQ so that clients map them by code, never
-- by message text. pgque/errors.py is their catalogue (a class per code,
-- saying when it is raised); the suite checks that every code raised here
-- has its class there.

-- pgque.version(): the version of the installed engine (the install script
-- puts the package's version, pgque.__version__, in its place).
create or replace function pgque.version()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select '0.13.0'::text $$;

-- pgque._name_for_message(text): a caller-supplied name (or other text) as
-- error messages show it: cut to 100 characters, with "..." when it was
-- longer, so that a huge name does not make a huge message (and server log
-- line). Every message that echoes what a caller passed goes through it.
create or replace function pgque._name_for_message(p_text text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when length(p_text) > 100 then left(p_text, 100) || '...' else p_text end
$$;

-- pgque._check_name(kind, name): raises PQ004 unless name is 1..100 characters
-- of letters, digits and _ . : - (starting with a letter or digit). '#' is
-- reserved for slot subscriptions, so caller text can never forge one.
create or replace function pgque._check_name(p_kind text, p_name text)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_name is null or p_name !~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$' then
        raise exception using
            errcode = 'PQ004',
            message = format('invalid %s name %L', p_kind, pgque._name_for_message(p_name)),
            hint = 'Use 1 to 100 letters, digits, "_", ".", ":" or "-", starting with a letter or digit.';
    end if;
end
$$;

-- pgque._queue_row(name): the queue row, or PQ001.
create or replace function pgque._queue_row(p_queue text)
returns pgque.queue
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
begin
    select * into v_queue from pgque.queue where queue_name = p_queue;
    if not found then
        raise exception using errcode = 'PQ001', message = format('queue %L does not exist',
                                                          pgque._name_for_message(p_queue));
    end if;
    return v_queue;
end
$$;

-- pgque._event_table(queue_id, n): the name (without schema) of event table n
-- of a queue, or of the queue's parent table when n is null. Built from
-- integers only, so nothing a caller types reaches dynamic SQL.
create or replace function pgque._event_table(p_queue_id integer, p_n integer default null)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_n is null then
        return 'event_' || p_queue_id::text;
    end if;
    return 'event_' || p_queue_id::text || '_' || p_n::text;
end
$$;

-- pgque._current_cursor(sub_id): the subscription's current cursor state (the newest
-- row of its cursor log in the partition written now, read backwards along
-- the primary key: one index probe; during a switch, a second one in the
-- partition left for a subscription not moved yet; see ticker/rotation.sql). Every
-- subscription has one there; a statement whose snapshot predates the
-- rotations that emptied the partition it names finds none, and gets 40001
-- (_cursor_missing), unless not strict: then null, as for a subscription that
-- does not exist (a look before the receive lock, which reads it again).
create or replace function pgque._current_cursor(p_sub_id integer, p_strict boolean default true)
returns pgque.cursor
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_parts record := pgque._cursor_parts();
    v_cur pgque.cursor;
begin
    select * into v_cur from pgque.cursor
     where cur_part = v_parts.part and cur_sub = p_sub_id order by cur_seq desc limit 1;
    if not found and v_parts.moved_from is not null then
        -- Not moved yet by a switch in progress: its newest row is in the other.
        select * into v_cur from pgque.cursor
         where cur_part = v_parts.moved_from and cur_sub = p_sub_id
         order by cur_seq desc limit 1;
    end if;
    if not found and p_strict then
        perform pgque._cursor_missing(p_sub_id);
    end if;
    return v_cur;
end
$$;

-- pgque._cursor_missing(sub_id): called when subscription sub_id has no
-- cursor in the partition of the cursor log written now, as the caller's
-- snapshot sees it: raises 40001 (serialization failure) when the
-- subscription exists, for then that snapshot is older than a rotation that
-- emptied the partition it names (a REPEATABLE READ transaction, or a
-- statement that ran for longer than a rotation period): going on without
-- the cursor could judge a batch, a tick or an event table unneeded. A
-- subscription that is gone has no cursor; the caller goes on without one.
create or replace function pgque._cursor_missing(p_sub_id integer)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if exists (select from pgque.subscription s where s.sub_id = p_sub_id) then
        raise exception using errcode = '40001',
            message = 'pgque rotated its cursor tables after this statement''s snapshot',
            hint = 'Retry the transaction.';
    end if;
end
$$;

-- pgque._cursor_moved(): raises 40001 (serialization failure): a cursor
-- state this transaction was about to append is there already. Under the
-- receive lock a cursor is read by a new statement, so this happens only to
-- a REPEATABLE READ or SERIALIZABLE transaction whose snapshot predates
-- another session's receive or ack of the same subscription: it read the
-- cursor as it was before them. The writers append with ON CONFLICT DO
-- NOTHING, under which PostgreSQL itself raises 40001 for such a
-- transaction; this is for any other way to get there.
create or replace function pgque._cursor_moved()
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    raise exception using errcode = '40001',
        message = 'a pgque cursor moved after this transaction''s snapshot',
        hint = 'Retry the transaction.';
end
$$;

-- pgque._save_cursor(cursor): appends the next state of a cursor (whose
-- subscription row the caller holds locked); 40001 when a state of that
-- number is there already (_cursor_moved).
create or replace function pgque._save_cursor(p_cur pgque.cursor)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                              cur_pos, cur_handed, cur_end, cur_part)
    values (p_cur.cur_sub, p_cur.cur_seq + 1, p_cur.cur_last_tick, p_cur.cur_batch,
            p_cur.cur_next_tick, p_cur.cur_pos, p_cur.cur_handed, p_cur.cur_end,
            pgque._write_part('cursor'))
    on conflict do nothing;
    if not found then
        perform pgque._cursor_moved();
    end if;
end
$$;

-- pgque._find_subscription(queue, consumer, lock): the subscription row of
-- consumer on queue (a row the caller looked up once) and its current cursor;
-- PQ002 when there is no such subscription. With lock, the subscription row is
-- taken FOR NO KEY UPDATE first: this is the receive lock that serializes a
-- consumer. (Not FOR UPDATE: that blocks the foreign-key checks of rows that
-- reference the subscription, such as the retries maintenance copies while it
-- holds the nack rotation's row, which a nack under this lock waits for: a
-- deadlock.) The cursor is read after it is granted (a new statement, so a fresh
-- snapshot). Without it, the cursor is null when a rotation emptied its
-- partition after this statement's snapshot (the callers look again, locked).
create or replace function pgque._find_subscription(
    p_queue pgque.queue, p_consumer text, p_lock boolean,
    out sub pgque.subscription, out cur pgque.cursor)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_lock then
        select * into sub from pgque.subscription s
         where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer
           for no key update;
    else
        select * into sub from pgque.subscription s
         where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer;
    end if;
    if not found then
        raise exception using
            errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L',
                             pgque._name_for_message(p_consumer), p_queue.queue_name);
    end if;
    -- Without the lock, a look that a rotation may outrun (see _current_cursor).
    cur := pgque._current_cursor(sub.sub_id, p_lock);
end
$$;

-- pgque._tick_snapshot(queue_id, tick_id): the snapshot stored by a tick.
create or replace function pgque._tick_snapshot(p_queue_id integer, p_tick_id bigint)
returns pg_snapshot
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select tick_snapshot from pgque.tick
             where tick_queue = p_queue_id and tick_id = p_tick_id);
end
$$;

-- pgque._random_key(): a fresh bigint for a session advisory lock key, from
-- the server's strong random source (gen_random_uuid), so that nobody can
-- guess the keys pgque's session locks use.
create or replace function pgque._random_key()
returns bigint
language sql volatile
set search_path = pg_catalog, pg_temp
as $$ select ('x' || encode(substr(sha256(uuid_send(gen_random_uuid())), 1, 8), 'hex'))::bit(64)::bigint $$;

-- ===== code/log/delay.sql =====
-- pgque: delayed events, moved into the log by the tick that passes their time.
--
-- A delayed send writes its event into pgque.delayed_event instead of the
-- log, under an id from the queue's event sequence that it returns. Ticks move them: each tick k of a
-- queue, made at time T(k) (its tick_time) with snapshot S(k), moves the
-- delayed events of the queue that S(k) sees and that are due by T(k), except
-- those the tick before already moved: those that S(k-1) saw and that were
-- due by T(k-1). By induction every event is moved once, by the first tick
-- that both sees it and has passed its time, and nothing marks a row moved:
-- the ticks are the record. The move runs in the tick's own transaction,
-- after the tick row, so the tick holds every event committed before it, and
-- the moved events get new ids from the queue's sequence, in due-time order,
-- after every id taken before: a delayed event enters its key's order when it falls due, as
-- if sent then (a batch, which may span several ticks, is read in id order).
-- Its ev_time is the tick's time, when it became ready; ev_delayed_id keeps
-- the id its send returned.
--
-- T(k) is the clock when the tick row is written, never less than T(k-1), so
-- no event enters the log before its time; ticks of a queue are serialized
-- (tick.sql), so T and S only grow. The ticker ticks a queue as soon as one of
-- its delayed events is due and not moved (_delayed_due), so an event falls
-- due within a ticker poll of its time, and is handed out at the tick after.
--
-- The rows stay until their partition is emptied (rotation.sql,
-- _rotate_delayed), which copies the rows not moved yet into the other one
-- as they are, transaction id included, while it holds their queues' tick
-- locks: the next tick judges the copies as the last one did the rows.

-- pgque._max_delay(): how far ahead an event may be sent, at most.
create or replace function pgque._max_delay()
returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select interval '30 days' $$;

-- pgque._due_times(count, deliver_ats, deliver_afters, now): the due time of
-- each of count events being sent at now, from its deliver_at or now plus its
-- deliver_after (either array may be null, or hold nulls: no delay); null for
-- an event to enter the log at once: no delay, or a due time not after now.
-- Raises 22023 when an event has both or an array's length is not count, and
-- PQ031 for a negative or infinite delay, or a due time more than _max_delay
-- ahead.
create or replace function pgque._due_times(p_count integer, p_deliver_ats timestamptz[],
                                            p_deliver_afters interval[], p_now timestamptz)
returns timestamptz[]
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_dues timestamptz[] := '{}';
    v_at timestamptz;
    v_after interval;
    v_due timestamptz;
    v_latest timestamptz := p_now + pgque._max_delay();
begin
    if p_deliver_ats is null and p_deliver_afters is null then
        return null;
    end if;
    -- Read by index below: one dimension, from 1, one element per event.
    if coalesce(cardinality(p_deliver_ats), p_count) <> p_count
       or coalesce(cardinality(p_deliver_afters), p_count) <> p_count
       or array_ndims(p_deliver_ats) > 1 or array_lower(p_deliver_ats, 1) <> 1
       or array_ndims(p_deliver_afters) > 1 or array_lower(p_deliver_afters, 1) <> 1 then
        raise exception using errcode = '22023',
            message = 'deliver_at and deliver_after must be one-dimensional arrays from 1, '
                      'with one element per event';
    end if;
    -- A loop over plain values: an event or a few per call, where a query
    -- over the arrays cost more than the send itself.
    for i in 1 .. p_count loop
        v_at := p_deliver_ats[i];
        v_after := p_deliver_afters[i];
        if v_at is not null and v_after is not null then
            raise exception using errcode = '22023',
                message = format('event %s has both deliver_at and deliver_after', i);
        elsif not isfinite(v_at) then
            raise exception using errcode = 'PQ031',
                message = format('event %s: deliver_at %s is not a finite time', i, v_at);
        elsif v_after < interval '0' then
            raise exception using errcode = 'PQ031',
                message = format('event %s: deliver_after %s is negative', i, v_after);
        end if;
        -- Compared before it is added: now plus a million years overflows.
        if v_after > pgque._max_delay() then
            v_due := 'infinity';
        else
            v_due := coalesce(v_at, p_now + v_after);
        end if;
        if v_due > v_latest then
            raise exception using errcode = 'PQ031',
                message = format('event %s: its due time %s is more than %s ahead',
                                 i, coalesce(v_at::text, format('now + %s', v_after)),
                                 pgque._max_delay()),
                hint = 'Delays go from 0 to 30 days; a due time in the past delivers at once.';
        end if;
        v_dues := v_dues || case when v_due > p_now then v_due end;
    end loop;
    return v_dues;
end
$$;

-- pgque._delayed_due(queue, last, upto): whether a delayed event of the queue
-- is due by upto and not moved by the tick last: one due since last's time,
-- or one that a transaction last did not see has sent. Reads only. The ticker
-- asks it of every queue at every poll (_tick_due, upto now), and a tick before
-- it moves anything (_make_tick, upto its time): each look is a bounded range
-- of one index (delayed_event_due, delayed_event_txid), so that the plan kept
-- for any queue is an index probe, even where another queue holds most of the
-- rows (an open-ended range let that plan scan the table), and an idle queue
-- pays a few cached probes. With since_only, the first look only: for a
-- caller that knows that no transaction last did not see can have sent one
-- (_tick_due: a settled tick, and no event id taken since it).
create or replace function pgque._delayed_due(p_queue_id integer, p_last pgque.tick,
                                              p_upto timestamptz,
                                              p_since_only boolean default false)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_txid xid8;
begin
    if exists (select from pgque.delayed_event d
                where d.de_queue = p_queue_id
                  and d.de_due > coalesce(p_last.tick_time, '-infinity')
                  and d.de_due <= p_upto) then
        return true;
    end if;
    if p_last.tick_id is null or p_since_only then
        return false;
    end if;
    -- Sent since last, by transactions committed now: ids up to this
    -- statement's snapshot.
    if exists (select from pgque.delayed_event d
                where d.de_queue = p_queue_id
                  and d.ev_txid >= pg_snapshot_xmax(p_last.tick_snapshot)
                  and d.ev_txid < pg_snapshot_xmax(pg_current_snapshot())
                  and d.de_due <= p_upto) then
        return true;
    end if;
    -- And by those in progress then, one probe each (a list of unknown length
    -- in one look gets a plan that scans).
    for v_txid in select pg_snapshot_xip(p_last.tick_snapshot) loop
        if exists (select from pgque.delayed_event d
                    where d.de_queue = p_queue_id and d.ev_txid = v_txid
                      and d.de_due <= p_upto) then
            return true;
        end if;
    end loop;
    return false;
end
$$;

-- pgque._move_delayed(queue, prev, tick): moves into the queue's current
-- event table the delayed events tick moves (see the top of this file): those
-- its snapshot sees, due by its time, and not moved by prev, the queue's tick
-- before (null: none). Returns how many. Runs in tick's transaction, after
-- tick was written.
create or replace function pgque._move_delayed(p_queue pgque.queue, p_prev pgque.tick,
                                               p_tick pgque.tick)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    -- New ids, from the insert's default in this order (by due time: as if
    -- each were sent when due; then as sent): the log's order.
    execute format(
        'insert into pgque.%I (ev_time, ev_type, ev_data, ev_extra1, ev_delayed_id)'
        ' select $2, d.ev_type, d.ev_data, d.ev_extra1, d.ev_id'
        '   from (select d.* from pgque.delayed_event d'
        '          where d.de_queue = $1 and d.de_due <= $2'
        '            and ($3 is null or d.de_due > $3)'
        '         union all'
        '         select d.* from pgque.delayed_event d'
        '          where d.de_queue = $1 and d.ev_txid >= $4 and d.de_due <= $3'
        '         union all'
        '         select d.* from pgque.delayed_event d'
        '          where d.de_queue = $1 and d.ev_txid = any($5) and d.de_due <= $3'
        '            and d.ev_txid < $4) d'
        '  where pg_visible_in_snapshot(d.ev_txid, $6)'
        '  order by d.de_due, d.ev_id',
        pgque._event_table(p_queue.queue_id, p_queue.queue_cur_table))
      using p_queue.queue_id, p_tick.tick_time, p_prev.tick_time,
            pg_snapshot_xmax(p_prev.tick_snapshot),
            array(select pg_snapshot_xip(p_prev.tick_snapshot)), p_tick.tick_snapshot;
    get diagnostics v_count = row_count;
    if v_count > 0 and p_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(p_queue.queue_id);  -- the tick after, at once (ticker/sleep.sql)
    end if;
    return v_count;
end
$$;

-- pgque._delayed_waiting(queue_id): the queue's delayed events not moved into
-- the log yet, as of its newest tick: how many, and the earliest due time.
-- Reads every such row: for status, not for a hot path.
create or replace function pgque._delayed_waiting(p_queue_id integer,
                                                  out waiting bigint, out next_due timestamptz)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    with last as (select * from pgque._last_tick(p_queue_id))
    select count(*), min(d.de_due)
      from pgque.delayed_event d, last l
     where d.de_queue = p_queue_id
       and not coalesce(d.de_due <= l.tick_time
                        and pg_visible_in_snapshot(d.ev_txid, l.tick_snapshot), false)
$$;

-- ===== code/log/idempotency.sql =====
-- pgque: idempotency keys: a send that happens once however often it is retried.
--
-- A send with an idempotency key records the key with the id of the event it
-- sends, in pgque.idempotency_key, in the sender's transaction: a rolled-back
-- send leaves no key. For the queue's idempotency window (queue setting
-- idempotency_window, 24 hours by default) a send of the same key writes
-- nothing and returns that id, as a duplicate. Two senders of one key at once
-- meet on the table's primary key: the second waits for the first to commit
-- or roll back, then takes the first's id or sends its own.
--
-- The table rotates (rotation.sql, _rotate_idempotency): written one
-- partition at a time, the one not written is emptied once every key in it is
-- older than the longest window, then the writes switch to it. The primary
-- key is per partition, so a switch must not come between two senders of a
-- key: each sender takes the table in ROW EXCLUSIVE mode before it reads which
-- partition to write, and holds it to its commit, and a switch takes the
-- table in SHARE mode, which waits for no sender (it tries without queueing)
-- and is granted only when none is in flight. A REPEATABLE READ or
-- SERIALIZABLE sender, whose snapshot may predate a switch, share-locks the
-- rotation row, which fails with 40001 when a switch committed since.

-- pgque._check_idempotency_keys(keys): raises PQ032 unless every non-null key
-- is 1 to 512 bytes long.
create or replace function pgque._check_idempotency_keys(p_keys text[])
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_bad integer;
begin
    select i into v_bad
      from unnest(p_keys) with ordinality as k(key, i)
     where octet_length(k.key) = 0 or octet_length(k.key) > 512
     order by i
     limit 1;
    if v_bad is not null then
        raise exception using errcode = 'PQ032',
            message = format('idempotency key %s is %s', v_bad,
                             case when octet_length(p_keys[v_bad]) = 0 then 'empty'
                                  else 'longer than 512 bytes' end);
    end if;
end
$$;

-- pgque._idempotency_part(): the partition of pgque.idempotency_key to write
-- now, after taking the table in ROW EXCLUSIVE mode until the transaction ends
-- (see the top of this file): two statements, so that in READ COMMITTED the
-- read sees a switch that the lock waited for.
create or replace function pgque._idempotency_part()
returns smallint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    lock table only pgque.idempotency_key in row exclusive mode;
    if current_setting('transaction_isolation') <> 'read committed' then
        -- 40001 when a switch committed after this transaction's snapshot.
        return (select r.rt_part from pgque.rotation r where r.rt_name = 'idempotency'
                   for share);
    end if;
    return (select r.rt_part from pgque.rotation r where r.rt_name = 'idempotency');
end
$$;

-- pgque._claim_idempotency_key(queue, part, key, id, due, now): records key
-- in partition part (from _idempotency_part) for an event sent at now with
-- id and due time due, unless the key has an unexpired record; returns the
-- record's event id and due time and duplicate true then, else id, due and
-- false. A sender of the key in flight makes this wait for its end; an
-- expired record in this partition is replaced in place. 40001 when the key
-- keeps changing under it (three rounds).
create or replace function pgque._claim_idempotency_key(
    p_queue pgque.queue, p_part smallint, p_key text, p_id bigint, p_due timestamptz,
    p_now timestamptz, out event_id bigint, out due timestamptz, out duplicate boolean)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_claimed boolean;
begin
    for v_attempt in 1 .. 3 loop
        select k.ik_event, k.ik_due into event_id, due
          from pgque.idempotency_key k
         where k.ik_queue = p_queue.queue_id and k.ik_key = p_key
           and k.ik_time > p_now - p_queue.queue_idempotency_window
         order by k.ik_time desc
         limit 1;
        if found then
            duplicate := true;
            return;
        end if;
        -- Not recorded (or expired): claim it. A sender of the key still in
        -- flight makes this wait; once it commits, the conflict says so.
        insert into pgque.idempotency_key as k (ik_queue, ik_key, ik_event, ik_time, ik_due,
                                                ik_part)
        values (p_queue.queue_id, p_key, p_id, p_now, p_due, p_part)
        on conflict (ik_queue, ik_key, ik_part) do update
           set ik_event = excluded.ik_event, ik_time = excluded.ik_time,
               ik_due = excluded.ik_due
         where k.ik_time <= p_now - p_queue.queue_idempotency_window
        returning true into v_claimed;
        if v_claimed then
            event_id := p_id;
            due := p_due;
            duplicate := false;
            return;
        end if;
        -- Lost to a sender that committed meanwhile: its record, next round.
    end loop;
    raise exception using errcode = '40001',
        message = format('idempotency key %L kept changing while it was sent',
                         pgque._name_for_message(p_key)),
        hint = 'Retry the transaction.';
end
$$;

-- pgque._claim_idempotency_keys(queue, keys, ids, dues, now): the keys of
-- events being sent at now, given as arrays (keys[i] null: event i has none),
-- each with the id and due time its event would have, claimed as
-- _claim_idempotency_key claims one; returns the arrays as they are to be
-- sent: the event of a key recorded in its window already, by an earlier send
-- or an earlier element of keys, takes the recorded id and due time and is a
-- duplicate. Set-based for the usual case (one lookup of all the keys, one
-- insert of the new ones, in key order, so two senders of the same keys
-- never wait for each other in a cycle); a key that insert could not claim
-- (a sender of it in flight, or its expired record in this partition) goes
-- through _claim_idempotency_key, still in key order.
create or replace function pgque._claim_idempotency_keys(
    p_queue pgque.queue, p_keys text[], p_ids bigint[], p_dues timestamptz[], p_now timestamptz,
    out ids bigint[], out duplicates boolean[], out dues timestamptz[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_part smallint := pgque._idempotency_part();
    v_keys text[];         -- the distinct keys, in key order ...
    v_firsts integer[];    -- ... and the position of each one's first event
    -- What each key resolved to (in no order): its event id, due time, and
    -- whether that is an earlier send's.
    v_done text[];
    v_events bigint[];
    v_due timestamptz[];
    v_duplicate boolean[];
    v_left record;
    v_claim record;
begin
    select array_agg(x.key order by x.key collate "C"), array_agg(x.first order by x.key collate "C")
      into v_keys, v_firsts
      from (select k.key, min(k.i)::integer as first
              from unnest(p_keys) with ordinality as k(key, i)
             where k.key is not null
             group by k.key) x;
    -- Recorded already, within the window.
    select coalesce(array_agg(r.ik_key), '{}'), coalesce(array_agg(r.ik_event), '{}'),
           coalesce(array_agg(r.ik_due), '{}'), coalesce(array_agg(true), '{}')
      into v_done, v_events, v_due, v_duplicate
      from (select distinct on (k.ik_key) k.ik_key, k.ik_event, k.ik_due
              from pgque.idempotency_key k
             where k.ik_queue = p_queue.queue_id and k.ik_key = any(v_keys)
               and k.ik_time > p_now - p_queue.queue_idempotency_window
             order by k.ik_key, k.ik_time desc) r;
    -- New: claimed in one insert, in key order; a conflict (a sender of the
    -- key in flight, or its expired record here) leaves the key to the loop.
    with claimed as (
        insert into pgque.idempotency_key (ik_queue, ik_key, ik_event, ik_time, ik_due, ik_part)
        select p_queue.queue_id, k.key, p_ids[k.first], p_now, p_dues[k.first], v_part
          from unnest(v_keys, v_firsts) as k(key, first)
         where not exists (select from unnest(v_done) d(key) where d.key = k.key)
         order by k.key collate "C"
        on conflict (ik_queue, ik_key, ik_part) do nothing
        returning ik_key, ik_event, ik_due)
    select v_done || coalesce(array_agg(c.ik_key), '{}'),
           v_events || coalesce(array_agg(c.ik_event), '{}'),
           v_due || coalesce(array_agg(c.ik_due), '{}'),
           v_duplicate || coalesce(array_agg(false), '{}')
      into v_done, v_events, v_due, v_duplicate
      from claimed c;
    for v_left in select k.key, k.first from unnest(v_keys, v_firsts) as k(key, first)
                   where not exists (select from unnest(v_done) d(key) where d.key = k.key)
                   order by k.key collate "C" loop
        v_claim := pgque._claim_idempotency_key(p_queue, v_part, v_left.key,
                                                p_ids[v_left.first], p_dues[v_left.first], p_now);
        v_done := v_done || v_left.key;
        v_events := v_events || v_claim.event_id;
        v_due := v_due || v_claim.due;
        v_duplicate := v_duplicate || v_claim.duplicate;
    end loop;
    -- Each event: its key's resolution; duplicate unless it is the first of a
    -- key that this send recorded.
    select array_agg(coalesce(r.event_id, p_ids[e.i]) order by e.i),
           array_agg(coalesce(r.duplicate or e.i <> f.first, false) order by e.i),
           array_agg(case when r.key is null then p_dues[e.i] else r.due end order by e.i)
      into ids, duplicates, dues
      from unnest(p_keys) with ordinality as e(key, i)
      left join unnest(v_keys, v_firsts) as f(key, first) on f.key = e.key
      left join unnest(v_done, v_events, v_due, v_duplicate) as r(key, event_id, due, duplicate)
        on r.key = e.key;
end
$$;

-- pgque._idempotency_keys(queue_id): how many keys the queue remembers now
-- (within its window). Reads every such row: for status, not a hot path.
create or replace function pgque._idempotency_keys(p_queue pgque.queue)
returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select count(distinct k.ik_key)
      from pgque.idempotency_key k
     where k.ik_queue = p_queue.queue_id
       and k.ik_time > clock_timestamp() - p_queue.queue_idempotency_window
$$;

-- ===== code/log/queue.sql =====
-- pgque: creating, configuring and dropping queues.

-- pgque._interval(key, value): a configuration value as an interval. Numbers
-- are seconds; strings are PostgreSQL interval literals. PQ007 otherwise.
create or replace function pgque._interval(p_key text, p_value jsonb)
returns interval
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_result interval;
begin
    begin
        if jsonb_typeof(p_value) = 'number' then
            v_result := make_interval(secs => (p_value #>> '{}')::double precision);
        elsif jsonb_typeof(p_value) = 'string' then
            v_result := (p_value #>> '{}')::interval;
        end if;
    exception when others then
        v_result := null;
    end;
    -- isfinite: PostgreSQL 17 has infinite intervals; a setting must be finite.
    if v_result is null or v_result < interval '0' or not isfinite(v_result) then
        raise exception using errcode = 'PQ007',
            message = format('%s must be a finite non-negative interval (seconds or an interval literal), not %s',
                             pgque._name_for_message(p_key), pgque._name_for_message(p_value::text));
    end if;
    return v_result;
end
$$;

-- pgque._integer(key, value, min, max): a configuration value as an integer
-- within [min, max]. PQ007 otherwise.
create or replace function pgque._integer(p_key text, p_value jsonb, p_min integer, p_max integer)
returns integer
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_result integer;
begin
    if jsonb_typeof(p_value) = 'number' and (p_value #>> '{}') ~ '^[0-9]+$'
       and length(p_value #>> '{}') <= 9 then
        v_result := (p_value #>> '{}')::integer;
    end if;
    if v_result is null or v_result < p_min or v_result > p_max then
        raise exception using errcode = 'PQ007',
            message = format('%s must be an integer from %s to %s, not %s', pgque._name_for_message(p_key),
                             p_min, p_max, pgque._name_for_message(p_value::text));
    end if;
    return v_result;
end
$$;

-- pgque._configure(queue, config, creating): the queue row with the settings
-- of config applied. Known keys: ticker_max_count, ticker_max_lag,
-- ticker_idle_period, rotation_period, max_retries, idempotency_window, and
-- (only when creating) event_tables. Unknown keys and bad values raise PQ007.
create or replace function pgque._configure(p_queue pgque.queue, p_config jsonb, p_creating boolean)
returns pgque.queue
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key text;
    v_value jsonb;
begin
    if p_config is null or jsonb_typeof(p_config) <> 'object' then
        raise exception using errcode = 'PQ007', message = 'queue configuration must be a JSON object';
    end if;
    for v_key, v_value in select * from jsonb_each(p_config) loop
        case v_key
        when 'ticker_max_count' then
            p_queue.queue_ticker_max_count := pgque._integer(v_key, v_value, 1, 100000000);
        when 'ticker_max_lag' then
            p_queue.queue_ticker_max_lag := pgque._interval(v_key, v_value);
        when 'ticker_idle_period' then
            p_queue.queue_ticker_idle_period := pgque._interval(v_key, v_value);
        when 'rotation_period' then
            p_queue.queue_rotation_period := pgque._interval(v_key, v_value);
        when 'max_retries' then
            p_queue.queue_max_retries := pgque._integer(v_key, v_value, 0, 1000000);
        when 'idempotency_window' then
            p_queue.queue_idempotency_window := pgque._interval(v_key, v_value);
            if p_queue.queue_idempotency_window <= interval '0'
               or p_queue.queue_idempotency_window > interval '30 days' then
                raise exception using errcode = 'PQ007',
                    message = format('idempotency_window must be more than 0 and at most 30 days, not %s',
                                     pgque._name_for_message(v_value::text));
            end if;
        when 'event_tables' then
            if not p_creating then
                raise exception using errcode = 'PQ007',
                    message = 'event_tables can only be set when the queue is created';
            end if;
            p_queue.queue_ntables := pgque._integer(v_key, v_value, 2, 64);
        else
            raise exception using errcode = 'PQ007',
                message = format('unknown queue setting %L', pgque._name_for_message(v_key)),
                hint = 'Known settings: ticker_max_count, ticker_max_lag, ticker_idle_period, '
                       'rotation_period, max_retries, idempotency_window, event_tables.';
        end case;
    end loop;
    return p_queue;
end
$$;

-- pgque._store_config(queue): writes a queue row's settings back to its row.
create or replace function pgque._store_config(p_queue pgque.queue)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    update pgque.queue
       set queue_event_seq = p_queue.queue_event_seq,
           queue_ntables = p_queue.queue_ntables,
           queue_rotation_period = p_queue.queue_rotation_period,
           queue_ticker_max_count = p_queue.queue_ticker_max_count,
           queue_ticker_max_lag = p_queue.queue_ticker_max_lag,
           queue_ticker_idle_period = p_queue.queue_ticker_idle_period,
           queue_max_retries = p_queue.queue_max_retries,
           queue_idempotency_window = p_queue.queue_idempotency_window
     where queue_id = p_queue.queue_id
$$;

-- pgque._lock_queue(queue_id, purpose, wait): takes the queue's lock row of
-- purpose ('tick' or 'maint', see pgque.queue_lock) FOR UPDATE, until the end
-- of the transaction; true when this transaction now holds it. With wait it
-- waits for another holder; without, it gives up at once when the row is
-- locked. False also when the row is gone: the queue was dropped.
create or replace function pgque._lock_queue(p_queue_id integer, p_purpose text, p_wait boolean)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_wait then
        perform from pgque.queue_lock where ql_queue = p_queue_id and ql_purpose = p_purpose
            for update;
    else
        perform from pgque.queue_lock where ql_queue = p_queue_id and ql_purpose = p_purpose
            for update skip locked;
    end if;
    return found;
end
$$;

-- pgque.create_queue(queue, config, exist_ok): creates a queue with its event
-- tables, sequence, lock rows and first tick; returns the queue id. An
-- existing queue raises PQ006 unless exist_ok, in which case its id is
-- returned unchanged. Concurrent creators of one name need no lock of their
-- own: the insert of the queue row waits for another transaction's
-- uncommitted row of that name, and finds it once that one commits.
create or replace function pgque.create_queue(
    p_queue text, p_config jsonb default '{}', p_exist_ok boolean default false)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue;
    v_parent text;
    v_child text;
    v_seq text;
    n integer;
begin
    -- Not while an install replaces the code this runs on (and no install
    -- while queues are made): installs take this row FOR UPDATE.
    perform from pgque.install_lock for share;
    perform pgque._check_name('queue', p_queue);
    loop
        -- Looked up first, so that exist_ok on an existing queue writes nothing.
        select * into v_queue from pgque.queue where queue_name = p_queue;
        if found then
            if p_exist_ok then
                return v_queue.queue_id;
            end if;
            raise exception using errcode = 'PQ006', message = format('queue %L already exists',
                                                              pgque._name_for_message(p_queue));
        end if;
        -- Insert with the table's defaults first, then apply the caller's
        -- settings. A concurrent creator's row of the same name makes this
        -- wait for its transaction: when that commits, nothing is inserted
        -- and the lookup above finds its queue; when it rolls back, this
        -- insert goes ahead.
        insert into pgque.queue (queue_name, queue_event_seq)
        values (p_queue, 'pgque.tick_id_seq'::regclass)
        on conflict (queue_name) do nothing
        returning * into v_queue;
        exit when found;
    end loop;
    insert into pgque.queue_lock (ql_queue, ql_purpose)
    values (v_queue.queue_id, 'tick'), (v_queue.queue_id, 'maint');
    v_queue := pgque._configure(v_queue, p_config, true);

    v_parent := pgque._event_table(v_queue.queue_id);
    v_seq := v_parent || '_id_seq';
    execute format('create sequence pgque.%I', v_seq);
    execute format('create table pgque.%I (like pgque.event_template including defaults)', v_parent);
    execute format('alter table pgque.%I alter column ev_id set default nextval(%L), '
                   'alter column ev_time set default now(), '
                   'alter column ev_txid set default pg_current_xact_id()',
                   v_parent, 'pgque.' || v_seq);
    for n in 0 .. v_queue.queue_ntables - 1 loop
        v_child := pgque._event_table(v_queue.queue_id, n);
        execute format('create table pgque.%I () inherits (pgque.%I)', v_child, v_parent);
        execute format('create index %I on pgque.%I (ev_txid)', v_child || '_txid_idx', v_child);
        -- An explicit ACL, as the install's revoke gives every table: the same
        -- rights as the default, and the same catalog whichever made the queue.
        execute format('revoke all on pgque.%I from public', v_child);
    end loop;
    execute format('revoke all on pgque.%I, pgque.%I from public', v_parent, v_seq);

    v_queue.queue_event_seq := ('pgque.' || v_seq)::regclass;
    perform pgque._store_config(v_queue);
    perform pgque._sync_batch_reader(v_queue.queue_id, false);
    perform pgque._sync_event_writer(false);

    perform pgque._make_tick(v_queue, p_settled => true);  -- nothing sent yet, nor can be
    return v_queue.queue_id;
end
$$;

-- pgque.set_queue_config(queue, config): changes settings of an existing
-- queue (see _configure for the keys); returns the new configuration.
create or replace function pgque.set_queue_config(p_queue text, p_config jsonb)
returns jsonb
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    perform pgque._store_config(pgque._configure(v_queue, p_config, false));
    return pgque.queue_config(p_queue);
end
$$;

-- pgque.queue_config(queue): the queue's settings as a JSON object (intervals
-- in seconds), in the shape create_queue and set_queue_config accept.
create or replace function pgque.queue_config(p_queue text)
returns jsonb
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    return jsonb_build_object(
        'ticker_max_count', v_queue.queue_ticker_max_count,
        'ticker_max_lag', extract(epoch from v_queue.queue_ticker_max_lag),
        'ticker_idle_period', extract(epoch from v_queue.queue_ticker_idle_period),
        'rotation_period', extract(epoch from v_queue.queue_rotation_period),
        'max_retries', v_queue.queue_max_retries,
        'idempotency_window', extract(epoch from v_queue.queue_idempotency_window),
        'event_tables', v_queue.queue_ntables);
end
$$;

-- pgque.drop_queue(queue, force): drops a queue with its events, ticks,
-- retries and dead letters. Refuses (PQ011) while consumers are subscribed,
-- unless force.
create or replace function pgque.drop_queue(p_queue text, p_force boolean default false)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_parent text := pgque._event_table(v_queue.queue_id);
begin
    perform from pgque.install_lock for share;  -- see create_queue
    -- Locks in the order the ticker and maintenance take them (the queue's
    -- tick lock, then its maintenance lock, then the queue row, then
    -- tables), so a running ticker or maintenance never deadlocks with a
    -- drop: it finishes its pass, or skips the queue. Once a concurrent drop
    -- of the same queue commits, its lock rows and queue row are gone and the
    -- check below raises PQ001.
    perform pgque._lock_queue(v_queue.queue_id, 'tick', true);
    perform pgque._lock_queue(v_queue.queue_id, 'maint', true);
    perform from pgque.queue where queue_id = v_queue.queue_id for update;
    if not found then
        raise exception using errcode = 'PQ001', message = format('queue %L does not exist',
                                                          pgque._name_for_message(p_queue));
    end if;
    if not p_force and exists (select 1 from pgque.subscription where sub_queue = v_queue.queue_id) then
        raise exception using errcode = 'PQ011',
            message = format('queue %L still has consumers', pgque._name_for_message(p_queue)),
            hint = 'Unsubscribe them first, or drop with force.';
    end if;
    -- Subscriptions go the one way they always go (cursors and retries with
    -- them); groups, ticks and dead letters go with the queue row.
    perform pgque._unsubscribe(
        v_queue.queue_id,
        array(select sub_consumer from pgque.subscription where sub_queue = v_queue.queue_id));
    delete from pgque.queue where queue_id = v_queue.queue_id;
    execute format('drop table pgque.%I cascade', v_parent);
    execute format('drop sequence pgque.%I cascade', v_parent || '_id_seq');
    perform pgque._drop_orphan_readers(false);
    perform pgque._sync_event_writer(false);
end
$$;

-- ===== code/log/send.sql =====
-- pgque: producing events.
--
-- Events are only ever INSERTed, into the queue's current event table, in the
-- caller's transaction: an event exists for consumers only if that
-- transaction commits. The partition key is stored in ev_extra1.

-- pgque._check_payloads(payloads): raises PQ005 unless every element is JSON
-- text (SQL NULL is allowed and means "no payload"). Validates without
-- writing, so the exception block costs no subtransaction id.
create or replace function pgque._check_payloads(p_payloads text[])
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_i integer;
begin
    begin
        perform p::json from unnest(p_payloads) p;
    exception when invalid_text_representation then
        -- Find the culprit for the message; this is the slow, rare path.
        for v_i in 1 .. coalesce(cardinality(p_payloads), 0) loop
            begin
                perform p_payloads[v_i]::json;
            exception when invalid_text_representation then
                raise exception using errcode = 'PQ005',
                    message = format('payload %s is not valid JSON: %s', v_i, sqlerrm);
            end;
        end loop;
    end;
end
$$;

-- pgque._check_keys(keys): raises PQ012 if a partition key is longer than
-- 512 bytes (a key is an identifier, not data).
create or replace function pgque._check_keys(p_keys text[])
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_too_long integer;
begin
    select i into v_too_long
      from unnest(p_keys) with ordinality as k(key, i)
     where octet_length(k.key) > 512
     limit 1;
    if v_too_long is not null then
        raise exception using errcode = 'PQ012',
            message = format('partition key %s is longer than 512 bytes', v_too_long);
    end if;
end
$$;

-- pgque._event_insert(queue_id, table, id, values): the INSERT of one event
-- into event table `table` of the queue, as SQL text: its ev_id from the
-- expression id, its type, payload and partition key from the three
-- expressions values, returning its ev_id. The one spelling of a sent event's
-- columns, for the event writer (static) and send (dynamic, for a table the
-- writer does not hold); send_batch adds ev_id to them. id and values are
-- pgque's own text, never a caller's.
create or replace function pgque._event_insert(p_queue_id integer, p_table integer,
                                               p_id text, p_values text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('insert into pgque.%I (ev_id, %s) values (%s, %s) returning ev_id',
                  pgque._event_table(p_queue_id, p_table), pgque._sent_columns(), p_id, p_values)
$$;

-- pgque._sent_columns(): the columns a sent event gives, in the order of
-- send's arguments; the others (ev_id, ev_time, ev_txid, ev_owner, ev_retry)
-- take their defaults.
create or replace function pgque._sent_columns()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'ev_type, ev_data, ev_extra1' $$;

-- pgque.send(queue, type, payload, partition_key): appends one event to the
-- queue's log in the caller's transaction and returns its ev_id.
-- Raises PQ001 (unknown queue), PQ005 (payload not JSON), PQ012 (key too long),
-- PQ015 (the queue's 'send' grants leave the caller out).
--
-- The hot path of every producer: it inserts through the event writer
-- (generated/event_writer.sql), which plans nothing, and checks its one payload
-- itself, with _check_payloads' error: building the array and calling that
-- helper cost 3 µs of the 20 this function took in a loop.
create or replace function pgque.send(
    p_queue text, p_type text, p_payload text, p_partition_key text default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue;
    v_id bigint;
begin
    -- _queue_row's lookup, written out: the nested call with its own
    -- search_path cost 7 µs of a one-event transaction; its error stays there.
    select * into v_queue from pgque.queue where queue_name = p_queue;
    if not found then
        perform pgque._queue_row(p_queue);
    end if;
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    begin
        perform p_payload::json;
    exception when invalid_text_representation then
        raise exception using errcode = 'PQ005',
            message = format('payload 1 is not valid JSON: %s', sqlerrm);
    end;
    if octet_length(p_partition_key) > 512 then
        perform pgque._check_keys(array[p_partition_key]);
    end if;
    perform pg_current_xact_id();  -- before the event id (log/tick.sql, "Settled ticks")
    v_id := pgque._write_event(v_queue.queue_id, v_queue.queue_cur_table, p_type, p_payload,
                               p_partition_key, null);
    if v_id is null then
        -- A table the writer does not know (generated/event_writer.sql): the same
        -- INSERT, planned here.
        execute pgque._event_insert(v_queue.queue_id, v_queue.queue_cur_table, 'default',
                                    '$1, $2, $3')
           into v_id
          using p_type, p_payload, p_partition_key;
    end if;
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);  -- at commit (ticker/sleep.sql)
    end if;
    return v_id;
end
$$;

-- pgque.send(queue, type, payload jsonb, partition_key): the same for a jsonb
-- payload.
create or replace function pgque.send(
    p_queue text, p_type text, p_payload jsonb, p_partition_key text default null)
returns bigint
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque.send(p_queue, p_type, p_payload::text, p_partition_key) $$;

-- pgque.send_batch(queue, types, payloads, partition_keys): appends several
-- events in one statement, in array order, and returns their ev_ids in the
-- same order. The arrays must have equal lengths; partition_keys may be null
-- (no keys). Nothing is inserted if any element is invalid.
create or replace function pgque.send_batch(
    p_queue text, p_types text[], p_payloads text[], p_partition_keys text[] default null)
returns bigint[]
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_ids bigint[];
begin
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    if coalesce(cardinality(p_types), 0) <> coalesce(cardinality(p_payloads), 0)
       or (p_partition_keys is not null
           and cardinality(p_partition_keys) <> coalesce(cardinality(p_types), 0)) then
        raise exception using errcode = '22023',
            message = 'send_batch: types, payloads and partition keys must have the same length';
    end if;
    if coalesce(cardinality(p_types), 0) = 0 then
        return '{}';
    end if;
    perform pgque._check_payloads(p_payloads);
    perform pgque._check_keys(p_partition_keys);
    -- The ids first, sorted, then the i-th event gets the i-th: ev_ids follow
    -- the array order whatever order nextval ran in, and the insert needs
    -- neither a sort of the rows nor RETURNING (together 13% of the call).
    perform pg_current_xact_id();  -- before the event ids (log/tick.sql, "Settled ticks")
    v_ids := array(select nextval(v_queue.queue_event_seq)
                     from generate_series(1, cardinality(p_types)) order by 1);
    execute format('insert into pgque.%I (ev_id, %s) select * from unnest($1, $2, $3, $4)',
                   pgque._event_table(v_queue.queue_id, v_queue.queue_cur_table),
                   pgque._sent_columns())
      using v_ids, p_types, p_payloads,
            coalesce(p_partition_keys, array_fill(null::text, array[cardinality(p_types)]));
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);
    end if;
    return v_ids;
end
$$;

-- What a send with options did with one event: its id (the id it has, or will
-- have, in the log), whether it was a duplicate of an earlier send of its
-- idempotency key (nothing written, the earlier event's id), and the time it
-- enters the log when delayed (else null).
create type pgque.sent_event as (
    event_id   bigint,
    duplicate  boolean,
    deliver_at timestamptz
);

-- pgque._send_events(queue, types, payloads, partition_keys, deliver_ats,
-- deliver_afters, idempotency_keys): send_batch with a due time and an
-- idempotency key per event (each array null, or holding nulls, for none),
-- in the caller's transaction. Returns one row per event, in array order.
-- Ids follow the array order. An event due now or earlier enters the log at
-- once; a later one waits in pgque.delayed_event (delay.sql). An event whose
-- idempotency key was sent within the queue's window, or earlier in the
-- arrays, is not written (idempotency.sql). Nothing is written if any element
-- is invalid: 22023 for arrays of other lengths or both kinds of delay, PQ005,
-- PQ012, PQ031 (delay), PQ032 (idempotency key), PQ001, PQ015 as for send.
create or replace function pgque._send_events(
    p_queue text, p_types text[], p_payloads text[], p_partition_keys text[],
    p_deliver_ats timestamptz[], p_deliver_afters interval[], p_idempotency_keys text[])
returns setof pgque.sent_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_count integer := coalesce(cardinality(p_types), 0);
    v_now timestamptz := clock_timestamp();
    v_dues timestamptz[];
    v_ids bigint[];
    v_duplicates boolean[];
    v_keys text[];
begin
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    if coalesce(cardinality(p_payloads), 0) <> v_count
       or coalesce(cardinality(p_partition_keys), v_count) <> v_count
       or coalesce(cardinality(p_idempotency_keys), v_count) <> v_count then
        raise exception using errcode = '22023',
            message = 'types, payloads, partition keys and idempotency keys must have the same length';
    end if;
    v_dues := pgque._due_times(v_count, p_deliver_ats, p_deliver_afters, v_now);
    if v_count = 0 then
        return;
    end if;
    perform pgque._check_payloads(p_payloads);
    perform pgque._check_keys(p_partition_keys);
    perform pgque._check_idempotency_keys(p_idempotency_keys);
    v_keys := coalesce(p_partition_keys, array_fill(null::text, array[v_count]));
    v_dues := coalesce(v_dues, array_fill(null::timestamptz, array[v_count]));
    -- The ids first, in array order (as send_batch), whether or not each
    -- event turns out to be sent: a duplicate's id is a gap in the sequence.
    perform pg_current_xact_id();  -- before the event ids (log/tick.sql, "Settled ticks")
    v_ids := array(select nextval(v_queue.queue_event_seq)
                     from generate_series(1, v_count) order by 1);
    v_duplicates := array_fill(false, array[v_count]);
    if exists (select from unnest(p_idempotency_keys) k where k is not null) then
        select c.ids, c.duplicates, c.dues into v_ids, v_duplicates, v_dues
          from pgque._claim_idempotency_keys(v_queue, p_idempotency_keys, v_ids, v_dues,
                                             v_now) c;
    end if;
    execute format('insert into pgque.%I (ev_id, %s)'
                   ' select e.id, e.type, e.data, e.key'
                   '   from unnest($1, $2, $3, $4, $5, $6) as e(id, type, data, key, due, dup)'
                   '  where e.due is null and not e.dup',
                   pgque._event_table(v_queue.queue_id, v_queue.queue_cur_table),
                   pgque._sent_columns())
      using v_ids, p_types, p_payloads, v_keys, v_dues, v_duplicates;
    insert into pgque.delayed_event (de_queue, de_due, ev_id, ev_time, ev_type, ev_data,
                                     ev_extra1, de_part)
    select v_queue.queue_id, e.due, e.id, now(), e.type, e.data, e.key,
           (select r.rt_part from pgque.rotation r where r.rt_name = 'delayed')
      from unnest(v_ids, p_types, p_payloads, v_keys, v_dues, v_duplicates)
           as e(id, type, data, key, due, dup)
     where e.due is not null and not e.dup;
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);
    end if;
    return query select i.id, i.dup, i.due
                   from unnest(v_ids, v_duplicates, v_dues) with ordinality as i(id, dup, due, n)
                  order by i.n;
end
$$;

-- pgque.send_with(queue, type, payload, partition_key, deliver_at,
-- deliver_after, idempotency_key): send with options, returning what it did
-- (pgque.sent_event). deliver_at (a time) or deliver_after (an interval from
-- now, by the database's clock) delays the event: it enters the log when it
-- falls due, as if sent then, and is never handed out earlier; a time not in
-- the future sends at once; more than 30 days ahead raises PQ031. With
-- idempotency_key (1 to 512 bytes, else PQ032), a send of a key already sent
-- within the queue's idempotency window writes nothing and returns the first
-- event's id, with duplicate true. Other errors as for send, and 22023 for
-- both delays. One event's path of _send_events, written out: no arrays, and
-- every statement static (a delayed send, a key) or send's own (neither).
create or replace function pgque.send_with(
    p_queue text, p_type text, p_payload text, p_partition_key text default null,
    p_deliver_at timestamptz default null, p_deliver_after interval default null,
    p_idempotency_key text default null)
returns pgque.sent_event
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue;
    v_now timestamptz := clock_timestamp();
    v_due timestamptz;
    v_claim record;
    v_id bigint;
begin
    if p_deliver_at is not null or p_deliver_after is not null then
        v_due := (pgque._due_times(1, array[p_deliver_at], array[p_deliver_after], v_now))[1];
    end if;
    if v_due is null and p_idempotency_key is null then
        -- No delay after all, no key: send's own path, its checks included.
        return row(pgque.send(p_queue, p_type, p_payload, p_partition_key), false,
                   null::timestamptz);
    end if;
    select * into v_queue from pgque.queue where queue_name = p_queue;
    if not found then
        perform pgque._queue_row(p_queue);
    end if;
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    begin
        perform p_payload::json;
    exception when invalid_text_representation then
        raise exception using errcode = 'PQ005',
            message = format('payload 1 is not valid JSON: %s', sqlerrm);
    end;
    if octet_length(p_partition_key) > 512 then
        perform pgque._check_keys(array[p_partition_key]);
    end if;
    perform pgque._check_idempotency_keys(array[p_idempotency_key]);
    perform pg_current_xact_id();  -- before the event id (log/tick.sql, "Settled ticks")
    v_id := nextval(v_queue.queue_event_seq);
    if p_idempotency_key is not null then
        v_claim := pgque._claim_idempotency_key(v_queue, pgque._idempotency_part(),
                                                p_idempotency_key, v_id, v_due, v_now);
        if v_claim.duplicate then
            return row(v_claim.event_id, true, v_claim.due);  -- v_id: a gap in the sequence
        end if;
    end if;
    if v_due is not null then
        insert into pgque.delayed_event (de_queue, de_due, ev_id, ev_time, ev_type, ev_data,
                                         ev_extra1, de_part)
        values (v_queue.queue_id, v_due, v_id, now(), p_type, p_payload, p_partition_key,
                (select r.rt_part from pgque.rotation r where r.rt_name = 'delayed'));
    elsif pgque._write_event(v_queue.queue_id, v_queue.queue_cur_table, p_type, p_payload,
                             p_partition_key, v_id) is null then
        -- A table the writer does not know (generated/event_writer.sql).
        execute pgque._event_insert(v_queue.queue_id, v_queue.queue_cur_table, '$4',
                                    '$1, $2, $3')
          using p_type, p_payload, p_partition_key, v_id;
    end if;
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);
    end if;
    return row(v_id, false, v_due);
end
$$;

-- pgque.send_batch_with(queue, types, payloads, partition_keys, deliver_ats,
-- deliver_afters, idempotency_keys): send_batch with options per event (any
-- array null for none), one pgque.sent_event per event in array order. A
-- batch may repeat a key: its first event is sent, the later ones are
-- duplicates of it. Nothing is written if any element is invalid.
create or replace function pgque.send_batch_with(
    p_queue text, p_types text[], p_payloads text[], p_partition_keys text[] default null,
    p_deliver_ats timestamptz[] default null, p_deliver_afters interval[] default null,
    p_idempotency_keys text[] default null)
returns setof pgque.sent_event
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select s.* from pgque._send_events(p_queue, p_types, p_payloads, p_partition_keys,
                                       p_deliver_ats, p_deliver_afters, p_idempotency_keys) s
$$;

-- ===== code/log/tick.sql =====
-- pgque: ticks.
--
-- A tick stores pg_current_snapshot() and the position of the queue's event
-- sequence. Consecutive ticks of a queue must be taken in snapshot order, or
-- a batch could miss events: ticks of one queue are serialized by the queue's
-- tick lock, its 'tick' row of pgque.queue_lock taken FOR UPDATE, and each
-- snapshot is taken in a statement after that lock is granted, which in READ
-- COMMITTED means after the previous tick committed. Ticks of different
-- queues take different rows and never wait for each other.
--
-- Taking the row assigns a transaction id and writes WAL, so the ticker
-- first looks, without it, whether a tick is due, and looks again once it
-- holds it: an idle poll writes nothing, and two tickers do not both tick.
--
-- Settled ticks. Whether a tick is due is counted by the queue's sequence,
-- except for one race: a transaction T that took an event id before the tick
-- read the sequence, and committed after the tick took its snapshot, left an
-- event the tick does not cover and the sequence does not count. Only an index
-- probe of the event tables finds it (_uncovered_events), and probing every
-- idle queue at every poll was most of the cost of a poll. So a tick records
-- when T can no longer exist:
--   * every sender assigns its transaction id before it takes an event id
--     (send.sql, and the retries and replays, which insert before nextval);
--   * the tick knows the sequence as it was before its own transaction had
--     an id (p_seq_before); when it reads the same value under the lock, no
--     id was taken between, so every T took its id, and so its transaction
--     id, before the tick's own: tick_settle_xid, the tick's own id, bounds
--     every T from above;
--   * once the oldest transaction running is past tick_settle_xid, every T
--     has ended; a probe then, in the same snapshot, that finds nothing finds
--     nothing ever after, and the poll marks the tick tick_settled
--     (_settle_tick); a tick whose snapshot shows no transaction running
--     below its own id is settled when made.
-- A settled tick is never probed again: an idle queue's poll is an index look
-- at its newest tick and a read of its sequence, in one statement for a chunk
-- of queues (_ticker_look). A tick without tick_settle_xid (the tick read the
-- sequence after its transaction had an id: a pgque.tick() inside a writing
-- transaction, or two tickers at once) is probed until the queue's next tick.

-- pgque._tick_channel(queue_id): the NOTIFY channel announcing ticks of a queue.
create or replace function pgque._tick_channel(p_queue_id integer)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return ('pgque_tick_' || p_queue_id::text);
end
$$;

-- pgque.tick_channel(queue): the channel to LISTEN on to hear of new ticks of
-- a queue (one notification per tick, with an empty payload).
create or replace function pgque.tick_channel(p_queue text)
returns text
language sql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._tick_channel((pgque._queue_row(p_queue)).queue_id) $$;

-- pgque._make_tick(queue, seq_before): makes a tick for the queue now,
-- unconditionally, and returns its id. Takes the queue's tick lock first,
-- waiting for a tick in progress elsewhere; raises PQ001 when the queue was
-- dropped meanwhile, and PQ008 outside READ COMMITTED, where the snapshot
-- would be the transaction's and could predate the previous tick. Then moves
-- into the log the delayed events the tick passes (delay.sql), for the tick
-- after. seq_before: the queue's sequence as read before this transaction had
-- an id, or null (see "Settled ticks" at the top); settled: the caller knows
-- that no event can be missed (the queue was made in this transaction, its
-- sequence unseen by any other).
create or replace function pgque._make_tick(p_queue pgque.queue, p_seq_before bigint default null,
                                            p_settled boolean default false)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_prev pgque.tick;
    v_tick pgque.tick;
    v_event_seq bigint;
    v_settle_xid xid8;
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        raise exception using errcode = 'PQ008',
            message = 'pgque ticks must be made in a READ COMMITTED transaction';
    end if;
    -- The queue's tick lock (held already when the ticker calls this). When
    -- it is gone, so is the queue: a drop committed while this waited.
    if not pgque._lock_queue(p_queue.queue_id, 'tick', true) then
        raise exception using errcode = 'PQ001', message = format('queue %L does not exist',
                                                          pgque._name_for_message(p_queue.queue_name));
    end if;
    v_prev := pgque._last_tick(p_queue.queue_id);
    -- The sequence position, read before the snapshot is taken: the insert
    -- below is a new statement, hence a new snapshot, after the lock too.
    v_event_seq := coalesce(pg_sequence_last_value(p_queue.queue_event_seq), 0);
    -- No event id taken since seq_before: every transaction this tick may miss
    -- has a lower id than this one (the top).
    if p_seq_before = v_event_seq then
        v_settle_xid := pg_current_xact_id();
    end if;
    -- Its time is the clock's, never before the last tick's: the delayed
    -- events due by then are moved below (delay.sql). Settled at once when its
    -- snapshot shows no transaction running below its own id.
    insert into pgque.tick (tick_queue, tick_id, tick_time, tick_snapshot, tick_event_seq,
                            tick_part, tick_settled, tick_settle_xid)
    values (p_queue.queue_id, nextval('pgque.tick_id_seq'),
            greatest(clock_timestamp(), v_prev.tick_time), pg_current_snapshot(), v_event_seq,
            pgque._write_part('tick'),
            p_settled
            or (v_settle_xid is not null
                and pg_snapshot_xmax(pg_current_snapshot()) >= v_settle_xid
                and not exists (select from pg_snapshot_xip(pg_current_snapshot()))),
            v_settle_xid)
    returning * into v_tick;
    -- The delayed events this tick passes, into the log for the next tick (the
    -- probes first: the move is planned at each call; where no queue has any,
    -- one look at the empty table). This transaction's own events are not in
    -- the tick: it is not settled after all.
    if exists (select from pgque.delayed_event)
       and pgque._delayed_due(p_queue.queue_id, v_prev, v_tick.tick_time) then
        if pgque._move_delayed(p_queue, v_prev, v_tick) > 0 and v_tick.tick_settled then
            update pgque.tick t set tick_settled = false
             where t.tick_queue = v_tick.tick_queue and t.tick_id = v_tick.tick_id
               and t.tick_part = v_tick.tick_part;
        end if;
    end if;
    -- Wake the queue's consumers. The notification carries nothing: it only
    -- says "look now", and the consumers' poll covers for a lost one.
    perform pg_notify(pgque._tick_channel(p_queue.queue_id), '');
    return v_tick.tick_id;
end
$$;

-- pgque.tick(queue): forces a tick of one queue now; returns its id.
create or replace function pgque.tick(p_queue text)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    return pgque._make_tick(v_queue, pgque._seq_before(v_queue));
end
$$;

-- Looks that must neither wait nor fail (_seq_before, _tick_wanted_nowait,
-- _settle_ready, _ticker_look, _maint_due; the info views' reads wait 100 ms)
-- wait for a lock at most lock_timeout and take an error for "cannot tell".
-- A wait whose lock is granted (a drop_queue commits) just as the timeout
-- fires leaves the timeout's cancel pending while the look fails on the
-- relation dropped meanwhile; PostgreSQL raises that cancel (55P03) at the
-- next statement, the first of the handler. So each such look is two blocks:
-- the inner one catches the look's error, the outer one the lock timeout its
-- handler may raise. And when the wait ends without an error (the holder
-- rolled back), the look's value is returned by a statement of its own inside
-- the inner block, which raises the cancel there: a RETURN of the look itself
-- left it to the caller's next statement.

-- pgque._seq_before(queue): the position of the queue's sequence, read now,
-- for a tick's seq_before (see the top): null when this transaction has an
-- id already. Neither waits nor fails (null instead): a drop_queue in
-- progress holds the sequence, and the tick lock, taken after, is what
-- waits for it and then says the queue is gone.
create or replace function pgque._seq_before(p_queue pgque.queue)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
declare
    v_seq bigint;
begin
    if pg_current_xact_id_if_assigned() is not null then
        return null;
    end if;
    begin
        v_seq := coalesce(pg_sequence_last_value(p_queue.queue_event_seq), 0);
        return v_seq;  -- (a statement of its own: see above)
    exception when others then
        null;  -- (a lock timeout left pending is raised here: see above)
    end;
    return null;
exception when lock_not_available then
    return null;
end
$$;

-- pgque._last_tick(queue_id): the newest tick of a queue.
create or replace function pgque._last_tick(p_queue_id integer)
returns pgque.tick
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tick pgque.tick;
begin
    select * into v_tick from pgque.tick where tick_queue = p_queue_id
     order by tick_id desc limit 1;
    return v_tick;
end
$$;

-- pgque._uncovered_events(queue_id, snapshot): whether any committed event of
-- the queue is not covered by a tick of snapshot, i.e. belongs to a
-- transaction not visible in it (at or past its xmax, or in its xip list).
-- Counting by sequence position cannot tell: an event whose ev_id was taken
-- before a tick by a transaction that committed after it lies below the
-- tick's position yet is not in its batch. An index probe on ev_txid, through
-- the queue's batch reader (its cover probe, consumers/read.sql: static SQL,
-- planned once per session, where a dynamic statement was planned at each of
-- the ticker's polls); transactions still in progress are invisible here and
-- simply skipped.
create or replace function pgque._uncovered_events(p_queue_id integer, p_snapshot pg_snapshot)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_req pgque.read_request;
begin
    v_req.prev_xmax := pg_snapshot_xmax(p_snapshot);
    v_req.prev_xip := array(select pg_snapshot_xip(p_snapshot));
    v_req.probe := true;
    return cardinality(pgque._run_reader(p_queue_id, v_req)) > 0;
end
$$;

-- pgque._tick_due(queue, last_tick, pending_only): whether the queue's
-- thresholds ask for a tick now: enough events pending (ticker_max_count), or
-- some pending for longer than ticker_max_lag, or none for ticker_idle_period;
-- with pending_only, whether any event is pending at all. Pending is
-- counted by sequence position since the last tick; when that says none and
-- the last tick is not settled, an index probe checks for committed events
-- it did not cover, and two more for a delayed event due and not moved
-- (_delayed_due).
create or replace function pgque._tick_due(p_queue pgque.queue, p_last pgque.tick,
                                           p_pending_only boolean default false)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_pending bigint := coalesce(pg_sequence_last_value(p_queue.queue_event_seq), 0)
                        - coalesce(p_last.tick_event_seq, 0);
    v_age interval := now() - p_last.tick_time;
begin
    if v_pending <= 0 and p_last.tick_id is not null and not p_last.tick_settled
       and pgque._uncovered_events(p_queue.queue_id, p_last.tick_snapshot) then
        v_pending := 1;
    end if;
    -- A delayed event due and not moved yet: the next tick moves it. (Where no
    -- queue has any, one look at the empty table says so.)
    if v_pending <= 0 and exists (select from pgque.delayed_event)
       and pgque._delayed_due(p_queue.queue_id, p_last, clock_timestamp(),
                              coalesce(p_last.tick_settled, false)) then
        v_pending := 1;
    end if;
    if p_pending_only then
        return v_pending > 0;
    end if;
    return p_last.tick_id is null
        or v_pending >= p_queue.queue_ticker_max_count
        or (v_pending > 0 and v_age >= p_queue.queue_ticker_max_lag)
        or v_age >= p_queue.queue_ticker_idle_period;
end
$$;

-- pgque._tick_wanted(queue, overdue): whether the queue should be ticked
-- now: with overdue null, whether its thresholds ask for a tick (_tick_due);
-- otherwise whether it has pending events and its last tick is at least
-- overdue old. Reads only.
create or replace function pgque._tick_wanted(p_queue pgque.queue, p_overdue interval)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_last pgque.tick := pgque._last_tick(p_queue.queue_id);
begin
    if p_overdue is not null and now() - v_last.tick_time < p_overdue then
        return false;
    end if;
    return pgque._tick_due(p_queue, v_last, p_overdue is not null);
end
$$;

-- pgque._tick_wanted_nowait(queue, overdue): _tick_wanted for the look taken
-- before the tick lock, which must neither wait nor fail: true when it cannot
-- tell at once, and the caller decides under the lock. A drop_queue holds
-- the queue's tables and sequence exclusively until it commits, and then they
-- are gone: reading them would wait for the drop and then fail, so every lock
-- is waited for at most 1 ms, and any error is left to the look under the
-- lock (which a drop never gets past, and which raises a real error again).
-- Reads only: the caught error costs a subtransaction without a transaction id.
create or replace function pgque._tick_wanted_nowait(p_queue pgque.queue, p_overdue interval)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
declare
    v_wanted boolean;
begin
    begin
        v_wanted := pgque._tick_wanted(p_queue, p_overdue);
        return v_wanted;  -- (a statement of its own: see _seq_before)
    exception when others then
        null;  -- (a lock timeout left pending is raised here: see _seq_before)
    end;
    return true;
exception when lock_not_available then
    return true;
end
$$;

-- pgque._tick_if_wanted(queue_id, overdue, wait): ticks the queue if
-- _tick_wanted says so, both before taking its tick lock (so a poll of an idle
-- queue takes no lock, assigns no transaction id and writes nothing) and
-- again under it, in a new statement that sees ticks committed meanwhile (so
-- two tickers do not both tick). The queue row is read again under the lock;
-- a queue dropped meanwhile is not touched. Without wait, a queue whose tick
-- lock is taken (being ticked or dropped elsewhere) is skipped at once.
-- Returns the new tick id, or null when none was made. seq_before: as for
-- _make_tick. sure: the caller has just seen that the thresholds ask for a
-- tick by the sequence alone (_ticker_look), so the look before the lock,
-- which would say so again, is skipped.
create or replace function pgque._tick_if_wanted(p_queue_id integer, p_overdue interval,
                                                 p_wait boolean, p_seq_before bigint default null,
                                                 p_sure boolean default false)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
begin
    select * into v_queue from pgque.queue where queue_id = p_queue_id;
    if not found then
        return null;
    end if;
    if not p_sure and not pgque._tick_wanted_nowait(v_queue, p_overdue) then
        return null;
    end if;
    if not pgque._lock_queue(p_queue_id, 'tick', p_wait) then
        return null;
    end if;
    select * into v_queue from pgque.queue where queue_id = p_queue_id;
    if not found then
        return null;
    end if;
    if not pgque._tick_wanted(v_queue, p_overdue) then
        return null;
    end if;
    return pgque._make_tick(v_queue, p_seq_before);
end
$$;

-- pgque.ticker(queue): ticks the queue if its thresholds ask for it; returns
-- the new tick id, or null when no tick was due. Waits for a tick of the
-- queue in progress elsewhere, then looks again.
create or replace function pgque.ticker(p_queue text)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    return pgque._tick_if_wanted(v_queue.queue_id, null, true, pgque._seq_before(v_queue));
end
$$;

-- pgque._ticker(overdue): ticks every queue whose thresholds ask for it;
-- with overdue, only those whose pending events have waited at least that
-- long since the queue's last tick. Returns how many ticks were made.
--
-- Lock order, shared with drop_queue and maintenance: a queue's tick lock
-- first, then its rows and tables. A queue whose tick lock is taken (being
-- ticked or dropped elsewhere) is skipped without waiting, and the queue row
-- is read again once the lock is held, so a queue dropped meanwhile is not
-- touched (see _tick_if_wanted).
create or replace function pgque._ticker(p_overdue interval)
returns integer
language sql
set search_path = pg_catalog, pg_temp
as $$ select s.ticks from pgque._ticker_some(p_overdue, null, null, null) s $$;

-- pgque._ticker_look(overdue, after, max_queues, queues): the look at a chunk
-- of queues that the tickers' poll starts with, one statement for all of them:
-- the queues whose ids are above after (null: from the first) and in queues
-- (null: any), at most max_queues plus one (null: every one), in id order, each with its
-- sequence's position (seq), whether a tick may be wanted (a superset of
-- _tick_wanted's answer, which decides under the lock: pending events by the
-- sequence, a threshold, the idle period, a delayed event due since the last
-- tick, or a last tick not settled, which only a probe can judge), whether
-- _tick_wanted would say yes now by the sequence and the clock alone (sure:
-- no probe needed; it says so again under the lock) and whether
-- its last tick may be settled now (settle: nothing pending by the sequence,
-- and the oldest transaction running is past its tick_settle_xid; see the
-- top). Reads only. Locks are waited for at most 1 ms: a drop_queue holds the
-- sequence it drops until it commits, and the caller falls back on a look
-- per queue when this fails.
create or replace function pgque._ticker_look(p_overdue interval, p_after integer,
                                              p_max_queues integer, p_queues integer[])
returns table (queue_id integer, seq bigint, wanted boolean, sure boolean, settle boolean)
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
#variable_conflict use_column
begin
    -- PL/pgSQL for its cached plan: the Ticker calls it every few milliseconds.
    return query
        select q.queue_id, s.seq, w.sure or w.maybe, w.sure,
               coalesce(s.seq <= t.tick_event_seq and not t.tick_settled
                        and pg_snapshot_xmin(pg_current_snapshot()) > t.tick_settle_xid, false)
          -- The queues named, by the primary key (one condition for both ways
          -- read every queue row: a hot poll of one queue among 5,000 took 1 ms).
          from (select u.*, row_number() over (order by u.queue_id) as n
                  from ((select l.* from pgque.queue l
                          where p_queues is null and (p_after is null or l.queue_id > p_after)
                          order by l.queue_id limit p_max_queues + 1)
                        union all
                        (select l.* from pgque.queue l
                          where l.queue_id = any(p_queues) and (p_after is null or l.queue_id > p_after)
                          order by l.queue_id limit p_max_queues + 1)) u
                 order by u.queue_id limit p_max_queues + 1) q
         -- (not the one past the chunk: its sequence stays unlocked)
         cross join lateral (select case when q.n <= p_max_queues or p_max_queues is null
                                         then coalesce(pg_sequence_last_value(q.queue_event_seq), 0)
                                    end as seq) s
          left join lateral (select l.tick_id, l.tick_time, l.tick_event_seq, l.tick_settled,
                                    l.tick_settle_xid
                               from pgque.tick l where l.tick_queue = q.queue_id
                              order by l.tick_id desc limit 1) t on true
         -- A delayed event due since the last tick (the first look of
         -- _delayed_due); where no queue has any, one look at the empty table.
         cross join lateral (select (select exists (select from pgque.delayed_event))
                                    and exists (select from pgque.delayed_event e
                                                 where e.de_queue = q.queue_id
                                                   and e.de_due > coalesce(t.tick_time, '-infinity')
                                                   and e.de_due <= clock_timestamp()) as due) d
         -- _tick_due's thresholds by the sequence (sure), or what a probe may
         -- find (maybe); with overdue, _tick_wanted's pending_only the same way.
         cross join lateral (select case when p_overdue is null
                                         then coalesce(t.tick_id is null
                                                       or s.seq - t.tick_event_seq >= q.queue_ticker_max_count
                                                       or (s.seq > t.tick_event_seq
                                                           and now() - t.tick_time >= q.queue_ticker_max_lag)
                                                       or now() - t.tick_time >= q.queue_ticker_idle_period,
                                                       false)
                                         else coalesce((t.tick_id is null or now() - t.tick_time >= p_overdue)
                                                       and s.seq > coalesce(t.tick_event_seq, 0), false)
                                    end as sure,
                                    coalesce(case when p_overdue is null
                                                  then not t.tick_settled or d.due
                                                  else (t.tick_id is null or now() - t.tick_time >= p_overdue)
                                                       and (not t.tick_settled or d.due)
                                             end, false) as maybe) w
         order by q.queue_id;
end
$$;

-- pgque._settle_ready(queue_id, tick): whether the queue's tick may be marked
-- settled: every transaction it may have missed has ended (the oldest running
-- is past its tick_settle_xid) and, in the same snapshot, none left an event
-- it did not cover or a delayed event due that it did not move. Reads only,
-- and neither waits nor fails, as _tick_wanted_nowait: the caller holds
-- sequence locks that a drop_queue waits for (_ticker_look), so a lock held
-- by a drop is waited for at most 1 ms, and an error says no.
create or replace function pgque._settle_ready(p_queue_id integer, p_tick pgque.tick)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
declare
    v_ready boolean;
begin
    begin
        -- (Due by the tick's time at least: a clock set back leaves it ahead.)
        v_ready := coalesce(pg_snapshot_xmin(pg_current_snapshot()) > p_tick.tick_settle_xid
                        and not pgque._uncovered_events(p_queue_id, p_tick.tick_snapshot)
                        and not (exists (select from pgque.delayed_event)
                                 and pgque._delayed_due(p_queue_id, p_tick,
                                                        greatest(clock_timestamp(), p_tick.tick_time))),
                        false);
        return v_ready;  -- (a statement of its own: see _seq_before)
    exception when others then
        null;  -- (a lock timeout left pending is raised here: see _seq_before)
    end;
    return false;
exception when lock_not_available then
    return false;
end
$$;

-- pgque._settle_tick(queue_id): marks the queue's last tick settled when it
-- may be (_settle_ready); returns whether it did. Waits for nothing: a tick
-- row locked elsewhere (another ticker settling it, a drop_queue deleting it)
-- is left for the next poll. Only in READ COMMITTED, and only after
-- _ticker_look in the same transaction: the rotations of the delayed events
-- and of the event tables copy rows and TRUNCATE, which an older snapshot
-- sees as empty; the look's locks on those tables keep a rotation from
-- committing until this transaction ends, and each statement here takes a
-- snapshot after any that committed before.
create or replace function pgque._settle_tick(p_queue_id integer)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tick pgque.tick := pgque._last_tick(p_queue_id);
begin
    if current_setting('transaction_isolation') <> 'read committed'
       or v_tick.tick_id is null or v_tick.tick_settled or v_tick.tick_settle_xid is null
       or not pgque._settle_ready(p_queue_id, v_tick) then
        return false;
    end if;
    update pgque.tick t set tick_settled = true
      from (select l.tick_queue, l.tick_id, l.tick_part from pgque.tick l
             where l.tick_queue = v_tick.tick_queue and l.tick_id = v_tick.tick_id
               and l.tick_part = v_tick.tick_part and not l.tick_settled
               for no key update skip locked) k
     where t.tick_queue = k.tick_queue and t.tick_id = k.tick_id and t.tick_part = k.tick_part;
    return found;
end
$$;

-- pgque._ticker_some(overdue, after, max_queues, queues): _ticker for the
-- queues whose ids are above after (null: from the first) and in queues
-- (null: any), at most max_queues of them (null: every one), in id order.
-- Returns the ticks made, the id of the last queue it looked at, or null when
-- no queue is left after it (so that a poll of fewer queues than max_queues
-- is one call), and the ids of the queues it ticked. The look at the
-- chunk is one statement (_ticker_look); only the queues it names are looked
-- at again, one by one, and ticked (_tick_if_wanted), and the last ticks it
-- names settled (_settle_tick). It keeps a lock on each queue's sequence until
-- the transaction ends (and a probe, on an event table): a statement over
-- thousands of queues outgrows the server's lock table ("out of shared
-- memory"), so the tickers go through them a few hundred per statement
-- (pgque.ticker_some).
create or replace function pgque._ticker_some(p_overdue interval, p_after integer,
                                              p_max_queues integer, p_queues integer[],
                                              out ticks integer, out last_queue integer,
                                              out ticked integer[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    -- The positions are read before this transaction has an id, or useless
    -- for settling (see the top).
    v_fresh boolean := pg_current_xact_id_if_assigned() is null;
    v_ids integer[];
    v_seqs bigint[];
    v_wanted boolean[];
    v_sure boolean[];
    v_settle boolean[];
    v_count integer;
    v_looked boolean := false;
begin
    ticks := 0;
    ticked := '{}';
    begin
        begin
            select coalesce(array_agg(l.queue_id order by l.queue_id), '{}'),
                   array_agg(l.seq order by l.queue_id), array_agg(l.wanted order by l.queue_id),
                   array_agg(l.sure order by l.queue_id), array_agg(l.settle order by l.queue_id)
              into v_ids, v_seqs, v_wanted, v_sure, v_settle
              from pgque._ticker_look(p_overdue, p_after, p_max_queues, p_queues) l;
            v_looked := true;  -- (also a statement of its own: see _seq_before)
        exception when others then
            null;  -- (a lock timeout left pending is raised here: see _seq_before)
        end;
    exception when lock_not_available then
        null;
    end;
    if not v_looked then
        -- A queue being dropped, most likely: every queue of the chunk is
        -- looked at by itself, as _tick_if_wanted does without waiting.
        v_ids := array(select q.queue_id from pgque.queue q
                        where (p_after is null or q.queue_id > p_after)
                          and (p_queues is null or q.queue_id = any(p_queues))
                        order by q.queue_id limit p_max_queues + 1);
        v_seqs := null;
        v_wanted := array_fill(true, array[cardinality(v_ids)]);
        v_sure := null;
        v_settle := array_fill(false, array[cardinality(v_ids)]);
    end if;
    -- One queue more than asked: whether any is left after the chunk.
    v_count := cardinality(v_ids);
    if v_count > p_max_queues then
        v_count := p_max_queues;
        last_queue := v_ids[v_count];
    end if;
    for i in 1 .. v_count loop
        if v_wanted[i] then
            if pgque._tick_if_wanted(v_ids[i], p_overdue, false,
                                     case when v_fresh then v_seqs[i] end,
                                     coalesce(v_sure[i], false)) is not null then
                ticks := ticks + 1;
                ticked := ticked || v_ids[i];
                continue;
            end if;
        end if;
        if v_settle[i] then
            perform pgque._settle_tick(v_ids[i]);
        end if;
    end loop;
end
$$;

-- pgque.ticker_some(after, max_queues, overdue, queues): ticker() (overdue
-- null) or tick_overdue(overdue) for at most max_queues queues (at least 1,
-- else 22023) whose ids are above after (null: from the first) and in queues
-- (null: any), in id order; returns the ticks made, the last queue id looked
-- at, null when no queue is left after it: call it again with that id until
-- then, each call its own transaction, so that no transaction holds locks on
-- every queue's tables; and the ids of the queues it ticked (the Ticker polls
-- those that were busy lately more often than the others).
create or replace function pgque.ticker_some(p_after integer, p_max_queues integer,
                                             p_overdue interval default null,
                                             p_queues integer[] default null,
                                             out ticks integer, out last_queue integer,
                                             out ticked integer[])
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if p_max_queues is null or p_max_queues < 1 then
        raise exception using errcode = '22023', message = 'max_queues must be at least 1';
    end if;
    if p_overdue < interval '0' then
        raise exception using errcode = '22023', message = 'after must not be negative';
    end if;
    select s.ticks, s.last_queue, s.ticked into ticks, last_queue, ticked
      from pgque._ticker_some(p_overdue, p_after, p_max_queues, p_queues) s;
end
$$;

-- pgque.ticker(): ticks every queue whose thresholds ask for it; returns how
-- many ticks were made.
create or replace function pgque.ticker()
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    return pgque._ticker(null);
end
$$;

-- pgque.tick_overdue(after): ticks every queue with pending events that have
-- waited at least after since its last tick, whatever its thresholds; returns
-- how many ticks were made. This is the standby tickers' safety net: when the
-- elected ticker is frozen or cut off (its session, and so its election lock,
-- still alive), delivery goes on with a delay of about after. Ticks of one
-- queue stay serialized, so running it beside the elected ticker is safe.
create or replace function pgque.tick_overdue(p_after interval)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if p_after is null or p_after < interval '0' then
        raise exception using errcode = '22023', message = 'after must not be negative';
    end if;
    return pgque._ticker(p_after);
end
$$;

-- ===== code/consumers/batch.sql =====
-- pgque: batches (receive, ack, nack).
--
-- A batch of a subscription is the set of events committed as of its next
-- tick's snapshot and not as of its last finished tick's snapshot. It is
-- fixed once opened, may be handed out in pieces (max_events), and is
-- finished by ack() only when every event in it was handed out.

-- pgque.batch_event: one received event, the one row type of every receive
-- (receive, receive_partitioned, ack_receive_partitioned, receive_slots):
-- the batch it belongs to, then the event. ev_extra1 is its partition key
-- (the name is PgQ's). epoch is the slot owner's fencing epoch for a slot's
-- batch (see slots/fence.sql), slot the slot; both null for a plain
-- consumer's. delayed_id is the id its delayed send returned, for an event
-- that waited as a delayed event (log/delay.sql). A batch with nothing left
-- to hand out is one row of nulls but batch_id (and slot, epoch).
create type pgque.batch_event as (
    batch_id  bigint,
    ev_id     bigint,
    ev_time   timestamptz,
    ev_retry  integer,
    ev_type   text,
    ev_data   text,
    ev_extra1 text,
    epoch     bigint,
    slot      integer,
    delayed_id bigint
);

-- pgque._next_tick(queue, cur): the tick that closes the next batch of a
-- cursor with no open batch, or null: the furthest tick whose sequence
-- position is at most ticker_max_count past the cursor's, so a consumer that
-- fell several ticks behind takes them in one batch of bounded size, and at
-- least the very next tick.
create or replace function pgque._next_tick(p_queue pgque.queue, p_cur pgque.cursor)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return coalesce(
        (select t.tick_id from pgque.tick t
          where t.tick_queue = p_queue.queue_id and t.tick_id > p_cur.cur_last_tick
            and t.tick_event_seq <= (select l.tick_event_seq from pgque.tick l
                                      where l.tick_queue = p_queue.queue_id
                                        and l.tick_id = p_cur.cur_last_tick)
                                    + p_queue.queue_ticker_max_count
          order by t.tick_id desc limit 1),
        (select t.tick_id from pgque.tick t
          where t.tick_queue = p_queue.queue_id and t.tick_id > p_cur.cur_last_tick
          order by t.tick_id limit 1));
end
$$;

-- pgque._check_max_events(max_events): 22023 unless null or at least 1.
create or replace function pgque._check_max_events(p_max_events integer)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_max_events is not null and p_max_events < 1 then
        raise exception using errcode = '22023', message = 'max_events must be at least 1';
    end if;
end
$$;

-- pgque._events_asked(max_events): how many events receive reads for a piece
-- of max_events (null: no limit): one more, to tell whether the batch goes
-- on; computed in bigint and capped, so that max_events = 2^31 - 1 does not
-- overflow (no batch holds that many events: no array could).
create or replace function pgque._events_asked(p_max_events integer)
returns integer
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_max_events is null then
        return null;
    end if;
    return least(p_max_events::bigint + 1, 2147483647)::integer;
end
$$;

-- pgque._has_next_tick(queue_id, cur): whether a cursor has a batch to open
-- or an open one: the check receive makes before taking any lock, so an idle
-- consumer's poll writes nothing and uses no transaction id.
create or replace function pgque._has_next_tick(p_queue_id integer, p_cur pgque.cursor)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return p_cur.cur_batch is not null
        or exists (select 1 from pgque.tick t
                    where t.tick_queue = p_queue_id and t.tick_id > p_cur.cur_last_tick);
end
$$;

-- pgque._receive(queue, sub, cur, max_events, slot, slots, ahead, ahead_next):
-- opens the next batch of the locked subscription sub (cursor cur), or
-- continues its open one, and returns up to max_events of its events not yet
-- acked, as rows (batch_id, event...). Batches with no events for this
-- subscription (or slot) are consumed on the spot, several in one call, so
-- consumers never see them. An open batch with nothing left yields one row
-- whose ev_id is null; no rows means there is no batch (no tick after the
-- last one). ahead, when given, are the first events (at most
-- _events_asked(max_events)) of the batch from cur's last tick to tick
-- ahead_next, read by the caller for this very cursor: that batch is opened
-- without reading it again.
create or replace function pgque._receive(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor, p_max_events integer,
    p_slot integer default null, p_slots integer default null,
    p_ahead pgque.event_template[] default null, p_ahead_next bigint default null)
returns setof pgque.batch_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_events pgque.event_template[];
    v_count integer;
    v_moved boolean := false;
    v_steps integer := 0;
    v_ask integer := pgque._events_asked(p_max_events);
    v_again boolean := false;
begin
    -- max_events was checked by the caller (receive, receive_partitioned).
    if p_cur.cur_batch is null then
        loop
            if v_steps = 0 and p_ahead is not null then
                -- Read by the caller for this cursor (receive_partitioned's
                -- _slot_read_ahead): the batch up to p_ahead_next.
                p_cur.cur_next_tick := p_ahead_next;
                v_events := p_ahead;
            else
                p_cur.cur_next_tick := pgque._next_tick(p_queue, p_cur);
                exit when p_cur.cur_next_tick is null;
                v_events := pgque._batch_events(
                    p_queue.queue_id, p_sub.sub_id,
                    pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
                    pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
                    0, null, v_ask, null, p_slot, p_slots);
            end if;
            exit when coalesce(cardinality(v_events), 0) > 0;
            -- Nothing here for us: consume the batch now instead of a round
            -- trip to hand out and ack nothing (bounded, to keep calls short).
            p_cur.cur_last_tick := p_cur.cur_next_tick;
            v_moved := true;
            v_steps := v_steps + 1;
            exit when v_steps >= 100;
        end loop;
        if coalesce(cardinality(v_events), 0) = 0 then
            if v_moved then
                p_cur.cur_next_tick := null;
                perform pgque._save_cursor(p_cur);
            end if;
            return;
        end if;
        p_cur.cur_batch := nextval('pgque.batch_id_seq');
        p_cur.cur_pos := 0;
        p_cur.cur_end := null;
    else
        -- A slot with blocked keys hands a piece out again as it was, whatever
        -- max_events now: the events it set aside stay ahead of the cursor
        -- until its ack (slots/pause.sql).
        v_again := p_slot is not null and coalesce(p_cur.cur_handed, 0) > coalesce(p_cur.cur_pos, 0)
                   and pgque._has_blocked(p_sub.sub_id);
        v_events := pgque._batch_events(
            p_queue.queue_id, p_sub.sub_id,
            pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
            pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
            p_cur.cur_pos, case when v_again then p_cur.cur_handed end,
            case when not v_again then v_ask end, null, p_slot, p_slots);
    end if;

    v_count := coalesce(cardinality(v_events), 0);
    if v_again then
        null;  -- the same piece: the cursor says so already
    elsif p_max_events is not null and v_count > p_max_events then
        v_events := v_events[1:p_max_events];
        v_count := p_max_events;
    else
        p_cur.cur_end := coalesce(v_events[v_count].ev_id, p_cur.cur_pos);
    end if;
    if not v_again then
        p_cur.cur_handed := coalesce(v_events[v_count].ev_id, p_cur.cur_pos);
        perform pgque._save_cursor(p_cur);
    end if;
    -- A slot with blocked keys (the pause policy, slots/pause.sql) sets their
    -- events aside instead of handing them out; the cursor passes them all the same.
    if p_slot is not null and pgque._has_blocked(p_sub.sub_id) then
        v_events := pgque._hold_events(p_sub.sub_id, p_cur.cur_batch, v_events);
        v_count := coalesce(cardinality(v_events), 0);
    end if;

    if v_count = 0 then
        return query select p_cur.cur_batch, null::bigint, null::timestamptz, null::integer,
                            null::text, null::text, null::text, null::bigint, p_slot,
                            null::bigint;
    else
        return query select p_cur.cur_batch, e.ev_id, e.ev_time, e.ev_retry, e.ev_type, e.ev_data,
                            e.ev_extra1, null::bigint, p_slot, e.ev_delayed_id
                       from unnest(v_events) e;
    end if;
end
$$;

-- pgque._ack_cursors(curs): acks what the latest receive handed out of the
-- open batch of each of curs (cursors of subscriptions the caller holds
-- locked, their batches checked): a piece that reached the end of its batch
-- finishes it and the cursor moves to its tick, else the position inside the
-- batch advances. One cursor write for them all; returns, in the order of
-- curs, whether each finished its batch. The one definition of what an ack
-- writes, for ack (one cursor) and ack_slots (slots/sets.sql).
create or replace function pgque._ack_cursors(p_curs pgque.cursor[])
returns boolean[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_done boolean[];
    v_saved integer;
begin
    with acked as (
        select i, p_curs[i] as cur,
               (p_curs[i]).cur_end is not null
               and (p_curs[i]).cur_handed >= (p_curs[i]).cur_end as finished
          from generate_subscripts(p_curs, 1) i
    ), saved as (
        insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                                  cur_pos, cur_handed, cur_end, cur_part)
        select (a.cur).cur_sub, (a.cur).cur_seq + 1,
               case when a.finished then (a.cur).cur_next_tick else (a.cur).cur_last_tick end,
               case when not a.finished then (a.cur).cur_batch end,
               case when not a.finished then (a.cur).cur_next_tick end,
               case when not a.finished then (a.cur).cur_handed end,
               case when not a.finished then (a.cur).cur_handed end,
               case when not a.finished then (a.cur).cur_end end,
               (select pgque._write_part('cursor'))
          from acked a
        on conflict do nothing
        returning 1
    )
    select array_agg(a.finished order by a.i), (select count(*) from saved)
      into v_done, v_saved
      from acked a;
    if v_saved < coalesce(cardinality(p_curs), 0) then
        perform pgque._cursor_moved();
    end if;
    return v_done;
end
$$;

-- pgque._ack(sub, cur, batch_id): acks what the latest receive handed out of
-- the open batch of the locked subscription sub (_ack_cursors); true when
-- that finished the batch. Raises PQ003 if batch_id is not the open batch.
create or replace function pgque._ack(p_sub pgque.subscription, p_cur pgque.cursor,
                                      p_batch_id bigint)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    return (pgque._ack_cursors(array[p_cur]))[1];
end
$$;

-- pgque._require_batch(sub, cur, batch_id): PQ003 unless batch_id is the open batch.
create or replace function pgque._require_batch(p_sub pgque.subscription, p_cur pgque.cursor,
                                                p_batch_id bigint)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_batch_id is null or p_cur.cur_batch is distinct from p_batch_id then
        raise exception using errcode = 'PQ003',
            message = format('batch %s is not the open batch of consumer %L', p_batch_id,
                             p_sub.sub_consumer);
    end if;
end
$$;

-- pgque._nack(queue, sub, cur, batch_id, ev_ids, reasons, retry_after, slot,
-- slots): sends events that the latest receive handed out of the open batch
-- to the retry queue, due after retry_after, or to dead letters once they were
-- retried max_retries times. reasons is null, one reason for all, or one per
-- id. Returns how many went to dead letters. The batch stays open: ack it as
-- usual. Idempotent per event and batch: an event nacked before in the same
-- open batch (a consumer that died between its nack and its ack, and nacks
-- again) is left as it is, so one failure is one retry or one dead letter
-- (its nack record, pgque.batch_nack, in the partition of the batch,
-- _nack_part, whose key a repeated nack hits, under REPEATABLE READ with a
-- snapshot older than the first nack too: 40001). The retries go to the
-- partition written now (rotation.sql).
-- Raises PQ003 if batch_id is not the open batch, PQ010 if an id is null or
-- not among the events handed out.
create or replace function pgque._nack(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor, p_batch_id bigint,
    p_ev_ids bigint[], p_reasons text[], p_retry_after interval,
    p_slot integer default null, p_slots integer default null,
    p_retry_afters interval[] default null, p_dead_ids bigint[] default null)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_events pgque.event_template[];
    v_wanted integer;
    v_dead integer;
    v_nack_part smallint;
    v_retry_part smallint;
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    perform pgque._check_nack_args(p_batch_id, p_ev_ids, p_reasons, p_retry_after,
                                   p_retry_afters, p_dead_ids);
    if coalesce(cardinality(p_ev_ids), 0) = 0 then
        return 0;
    end if;
    -- Looked up only now: an ack of a slot passes here with no ids each time.
    v_nack_part := pgque._nack_part(p_batch_id);
    v_retry_part := pgque._write_part('retry');
    v_events := pgque._batch_events(
        p_queue.queue_id, p_sub.sub_id,
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
        coalesce(p_cur.cur_pos, 0), p_cur.cur_handed, null, p_ev_ids,
        p_slot, p_slots);
    select count(distinct i) into v_wanted from unnest(p_ev_ids) i;
    if (select count(distinct e.ev_id) from unnest(v_events) e) <> v_wanted then
        raise exception using errcode = 'PQ010',
            message = format('nack: some of events %s are not among those handed out of batch %s',
                             pgque._name_for_message(p_ev_ids::text), p_batch_id);
    end if;

    -- One row per event id: its newest copy (a batch holds two copies of an
    -- id only if a retry was re-inserted beside the original), with its
    -- reason, and only if this batch has not nacked it already.
    with asked as (
        select i.id, case when cardinality(p_reasons) = 1 then p_reasons[1]
                          else p_reasons[i.n] end as reason,
               coalesce(p_retry_afters[i.n], p_retry_after) as delay,
               i.id = any(coalesce(p_dead_ids, '{}')) as dead
          from unnest(p_ev_ids) with ordinality i(id, n)),
    fresh as (
        insert into pgque.batch_nack (bn_sub, bn_batch, bn_ev_id, bn_part)
        select distinct p_sub.sub_id, p_batch_id, a.id, v_nack_part from asked a
        on conflict do nothing
        returning bn_ev_id),
    nacked as (
        select distinct on (e.ev_id) e.*, a.reason, a.delay, a.dead
          from unnest(v_events) e
          cross join lateral (select a.reason, a.delay, a.dead from asked a
                               where a.id = e.ev_id limit 1) a
          join fresh f on f.bn_ev_id = e.ev_id
         order by e.ev_id, e.ev_retry desc),
    dead as (
        insert into pgque.dead_letter (dl_queue, dl_consumer, dl_sub, dl_reason, ev_id, ev_time,
                                       ev_txid, ev_retry, ev_type, ev_data, ev_extra1)
        select p_queue.queue_id, p_sub.sub_consumer, p_sub.sub_id, e.reason, e.ev_id, e.ev_time,
               e.ev_txid, e.ev_retry, e.ev_type, e.ev_data, e.ev_extra1
          from nacked e
         where e.ev_retry >= p_queue.queue_max_retries or e.dead
        returning 1),
    retried as (
        insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time,
                                       ev_retry, ev_type, ev_data, ev_extra1, ev_delayed_id,
                                       rq_part)
        select now() + e.delay, p_queue.queue_id, p_sub.sub_id, e.ev_id, e.ev_time,
               e.ev_retry + 1, e.ev_type, e.ev_data, e.ev_extra1, e.ev_delayed_id, v_retry_part
          from nacked e
         where e.ev_retry < p_queue.queue_max_retries and not e.dead
        returning 1)
    select (select count(*) from dead) into v_dead;
    return v_dead;
end
$$;

-- pgque._plain_sub(queue, consumer, lock): the queue and subscription rows
-- and cursor of a plain consumer (as _find_subscription gives them, with the
-- receive lock when lock), refusing slot subscriptions (PQ021: they go
-- through the partition layer, which checks ownership) and callers that may
-- not use the consumer (PQ014, PQ015).
create or replace function pgque._plain_sub(
    p_queue text, p_consumer text, p_lock boolean,
    out queue pgque.queue, out sub pgque.subscription, out cur pgque.cursor)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    queue := pgque._queue_row(p_queue);
    select * into v from pgque._find_subscription(queue, p_consumer, p_lock);
    if position('#' in (v.sub).sub_consumer) > 0 then
        raise exception using errcode = 'PQ021',
            message = format('%L is a slot subscription; use receive_partitioned and its ack',
                             (v.sub).sub_consumer);
    end if;
    perform pgque._require_consumer(queue, (v.sub).sub_owner, (v.sub).sub_grantees,
                                    p_consumer);
    sub := v.sub;
    cur := v.cur;
end
$$;

-- pgque._handed_whole(): the position (cur_handed, cur_end) of a batch that
-- receive handed out whole, its rows straight from the reader (see receive):
-- past any event id, so the ack that follows finishes the batch.
create or replace function pgque._handed_whole()
returns bigint
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return 9223372036854775807;  -- PL/pgSQL: on the hot path (design-notes.md)
end
$$;

-- pgque.receive(queue, consumer, max_events): the consumer's open batch, or
-- its next one, as pgque.batch_event rows (epoch null), at most max_events
-- of them (null: the whole batch).
-- Blocks while another session holds the same subscription's receive lock,
-- then returns the same open batch. An open batch with no events left yields
-- one row with a null ev_id; no rows means no batch is ready.
-- The whole batch (max_events null) is returned as the queue's batch reader
-- reads it, row by row, and the cursor then records it as handed out whole
-- (_handed_whole): collecting the rows into an array first, as pieces and
-- slots need (_receive), cost twice the read. Its batch id is taken before
-- the read, so a call that finds only batches with no events for this
-- consumer (consumed on the spot, as _receive does) leaves a gap in the ids.
create or replace function pgque.receive(p_queue text, p_consumer text, p_max_events integer default null)
returns setof pgque.batch_event
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_cur pgque.cursor;
    v_rows text;
    v_opening boolean;
    v_count integer := 0;
    v_steps integer := 0;
begin
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._plain_sub(p_queue, p_consumer, false);
    if not pgque._has_next_tick((v.queue).queue_id, v.cur) then
        return;  -- idle: no lock taken, nothing written
    end if;
    select v.queue, f.sub, f.cur into v
      from pgque._find_subscription(v.queue, p_consumer, true) f;
    v_rows := 'pgque.' || pgque._batch_reader_name((v.queue).queue_id);
    if p_max_events is not null or to_regproc(v_rows) is null then
        return query select * from pgque._receive(v.queue, v.sub, v.cur, p_max_events);
        return;
    end if;
    -- The reader's plain branch (every reader has one), its rows as they come;
    -- reader names are pgque's own text.
    v_rows := format('select $2, r.ev_id, r.ev_time, r.ev_retry, r.ev_type, r.ev_data,'
                     ' r.ev_extra1, null::bigint, null::integer, r.ev_delayed_id'
                     ' from %s($1) r', v_rows);
    -- An open batch is read again from its position; else the next batch,
    -- past those with nothing for this consumer, consumed on the spot as
    -- _receive does (bounded, to keep calls short).
    v_cur := v.cur;
    v_opening := v_cur.cur_batch is null;
    if v_opening then
        v_cur.cur_batch := nextval('pgque.batch_id_seq');
        v_cur.cur_pos := 0;
    end if;
    loop
        if v_opening then
            v_cur.cur_next_tick := pgque._next_tick(v.queue, v_cur);
            exit when v_cur.cur_next_tick is null;
        end if;
        return query execute v_rows
            using pgque._batch_request(
                      (v.sub).sub_id,
                      pgque._tick_snapshot((v.queue).queue_id, v_cur.cur_last_tick),
                      pgque._tick_snapshot((v.queue).queue_id, v_cur.cur_next_tick),
                      v_cur.cur_pos, null, null, null),
                  v_cur.cur_batch;
        get diagnostics v_count = row_count;
        exit when v_count > 0 or not v_opening;
        v_cur.cur_last_tick := v_cur.cur_next_tick;
        v_steps := v_steps + 1;
        exit when v_steps >= 100;
    end loop;
    if v_count = 0 and v_opening then
        if v_steps > 0 then  -- the batches passed, with no batch open
            v_cur.cur_batch := null;
            v_cur.cur_next_tick := null;
            v_cur.cur_pos := (v.cur).cur_pos;
            perform pgque._save_cursor(v_cur);
        end if;
        return;
    end if;
    if v_count = 0 then  -- an open batch with nothing left
        return query select v_cur.cur_batch, null::bigint, null::timestamptz, null::integer,
                            null::text, null::text, null::text, null::bigint, null::integer,
                            null::bigint;
    end if;
    v_cur.cur_handed := pgque._handed_whole();
    v_cur.cur_end := v_cur.cur_handed;
    perform pgque._save_cursor(v_cur);
end
$$;

-- pgque.ack(queue, consumer, batch_id): acks what the latest receive handed
-- out; true when that finished the batch, false when more of it remains.
create or replace function pgque.ack(p_queue text, p_consumer text, p_batch_id bigint)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._plain_sub(p_queue, p_consumer, true);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
$$;

-- pgque.nack(queue, consumer, batch_id, ev_ids, retry_after, reason): sends
-- handed-out events of the open batch to retry (or dead letters); returns
-- how many went to dead letters. Ack the batch afterwards as usual.
create or replace function pgque.nack(
    p_queue text, p_consumer text, p_batch_id bigint, p_ev_ids bigint[],
    p_retry_after interval default '0', p_reason text default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._plain_sub(p_queue, p_consumer, true);
    return pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_ev_ids, array[p_reason],
                       p_retry_after);
end
$$;

-- pgque.ack(queue, consumer, batch_id, nack_ids, nack_reasons, retry_after):
-- nacks the given handed-out events (as nack() does, with one reason for all
-- or one per id) and acks the batch piece, in one transaction: a consumer
-- cannot end up having nacked without acking. Returns what ack() returns.
create or replace function pgque.ack(
    p_queue text, p_consumer text, p_batch_id bigint, p_nack_ids bigint[],
    p_nack_reasons text[], p_retry_after interval)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._plain_sub(p_queue, p_consumer, true);
    perform pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_nack_ids, p_nack_reasons,
                        p_retry_after);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
$$;

-- pgque.ack(queue, consumer, batch_id, nack_ids, nack_reasons, retry_after,
-- retry_afters, dead_ids): the same, with a delay per failed event
-- (retry_afters, one per nack id; a null one: retry_after) and the failed
-- events not to retry (dead_ids, among nack_ids: to the dead letters now).
create or replace function pgque.ack(
    p_queue text, p_consumer text, p_batch_id bigint, p_nack_ids bigint[],
    p_nack_reasons text[], p_retry_after interval, p_retry_afters interval[],
    p_dead_ids bigint[])
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._plain_sub(p_queue, p_consumer, true);
    perform pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_nack_ids, p_nack_reasons,
                        p_retry_after, null, null, p_retry_afters, p_dead_ids);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
$$;

-- ===== code/consumers/dead_letters.sql =====
-- pgque: retries and dead letters.

-- pgque._may_use_consumer_name(queue, name, role): whether role (an oid) may
-- use the subscription of that name on queue: a name without '#' is a plain
-- consumer, one with '#' ("group#k/n", or just "group#") stands for its group.
-- A group named like a plain consumer opens nothing of it.
create or replace function pgque._may_use_consumer_name(
    p_queue pgque.queue, p_consumer text, p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select 1 from pgque.subscription s
                    where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer
                      and position('#' in p_consumer) = 0
                      and pgque._may_consume(p_role, p_queue, s.sub_owner, s.sub_grantees))
        or exists (select 1 from pgque.consumer_group g
                    where g.cg_queue = p_queue.queue_id
                      and g.cg_consumer = split_part(p_consumer, '#', 1)
                      and position('#' in p_consumer) > 0
                      and pgque._may_consume(p_role, p_queue, g.cg_owner, g.cg_grantees))
$$;

-- Dead letters belong to the subscription that made them (dl_sub). An admin
-- may list, replay and purge every one. Any other role may do so with those
-- of the subscriptions it may use (it owns the consumer or group, or was
-- granted it: see base/access.sql), within the queue's 'consume' grants. The
-- dead letters of a subscription that is gone are the admins' alone, even once
-- another consumer takes its name: that one is another subscription (and a
-- group subscribed again has new slot subscriptions). Every refusal (PQ015 for
-- the queue, PQ014 for the consumer) is raised before anything changes, and
-- says what the role lacks.

-- pgque._may_use_dead_letters(queue, sub_id, role): whether role (an oid)
-- may list, replay and purge the dead letters that subscription sub_id made:
-- it must still exist and role may use it (its group, for a slot).
create or replace function pgque._may_use_dead_letters(
    p_queue pgque.queue, p_sub_id integer, p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select 1 from pgque.subscription s
                    where s.sub_id = p_sub_id and s.sub_queue = p_queue.queue_id
                      and pgque._may_use_consumer_name(p_queue, s.sub_consumer, p_role))
$$;

-- pgque._refuse_dead_letters(queue, action, consumer, gone, dl_id): raises
-- PQ014: the caller may not action ('list', 'replay' or 'purge') the dead
-- letters of consumer (a plain consumer's name, a group's, or a slot
-- subscription's, which stands for its group). The message says what the
-- role lacks: to own the consumer or be granted it, or to be in pgque_admin;
-- when gone (no such consumer is subscribed or, given dl_id, the subscription
-- that made that dead letter was unsubscribed), that only admins may.
create or replace function pgque._refuse_dead_letters(
    p_queue pgque.queue, p_action text, p_consumer text, p_gone boolean,
    p_dl_id bigint default null)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_caller name := pgque._caller();
    v_name text := pgque._name_for_message(split_part(p_consumer, '#', 1));
    v_owner oid;
begin
    if p_gone and p_dl_id is not null then
        raise exception using errcode = 'PQ014',
            message = format('role %s may not %s dead letter %s of queue %L: consumer %L, which '
                             'made it, was unsubscribed, and the dead letters of an unsubscribed '
                             'consumer are for pgque_admin alone',
                             v_caller, p_action, p_dl_id, p_queue.queue_name, v_name);
    end if;
    if p_gone then
        raise exception using errcode = 'PQ014',
            message = format('role %s may not %s dead letters of consumer %L of queue %L: no such '
                             'consumer is subscribed, and the dead letters of an unsubscribed '
                             'consumer are for pgque_admin alone',
                             v_caller, p_action, v_name, p_queue.queue_name);
    end if;
    v_owner := coalesce(
        (select s.sub_owner from pgque.subscription s
          where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer
            and position('#' in p_consumer) = 0),
        (select g.cg_owner from pgque.consumer_group g
          where g.cg_queue = p_queue.queue_id
            and g.cg_consumer = split_part(p_consumer, '#', 1)));
    raise exception using errcode = 'PQ014',
        message = format('role %s may not %s dead letters of consumer %L of queue %L: it needs to '
                         'own the consumer or be granted it (pgque.grant_consumer), or be in '
                         'pgque_admin', v_caller, p_action, v_name, p_queue.queue_name),
        hint = case when v_owner is not null then
                   format('It belongs to role %s; its owner or an admin may grant it with '
                          'pgque.grant_consumer(%L, %L, %L).', v_owner::regrole,
                          p_queue.queue_name, v_name, v_caller) end;
end
$$;

-- pgque._dead_letter_access(queue, action, consumer): the check every
-- dead-letter function makes first; returns whether the caller is an admin,
-- who may do everything. Any other role must pass the queue's 'consume'
-- grants (PQ015 otherwise) and, when consumer is given, may use the plain
-- consumer or the consumer group of that name (PQ014 otherwise). action
-- ('list', 'replay' or 'purge') is for the messages.
create or replace function pgque._dead_letter_access(
    p_queue pgque.queue, p_action text, p_consumer text default null)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_caller name := pgque._caller();
    v_role oid;
begin
    if pgque._is_admin(v_caller) then
        return true;
    end if;
    v_role := pgque._role_id(v_caller);
    if p_queue.queue_consumers is not null
       and not pgque._in_roles(v_role, p_queue.queue_consumers) then
        raise exception using errcode = 'PQ015',
            message = format('role %s may not %s dead letters of queue %L: it needs to be granted '
                             '''consume'' on the queue (pgque.grant_queue), or be in pgque_admin',
                             v_caller, p_action, p_queue.queue_name),
            hint = format('An admin grants it with pgque.grant_queue(%L, %L, ''consume'').',
                          p_queue.queue_name, v_caller);
    end if;
    -- The name given may be a plain consumer's or a group's.
    if p_consumer is not null
       and not pgque._may_use_consumer_name(p_queue, p_consumer, v_role)
       and not pgque._may_use_consumer_name(p_queue, p_consumer || '#', v_role) then
        perform pgque._refuse_dead_letters(
            p_queue, p_action, p_consumer,
            not exists (select 1 from pgque.subscription s
                         where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer
                           and position('#' in p_consumer) = 0)
            and not exists (select 1 from pgque.consumer_group g
                             where g.cg_queue = p_queue.queue_id
                               and g.cg_consumer = split_part(p_consumer, '#', 1)));
    end if;
    return false;
end
$$;

-- pgque.dead_letters(queue, consumer, limit, after_id): dead letters of a
-- queue (of one consumer, or of every slot of a consumer group, when given),
-- oldest first, after dl_id after_id. A role that is not an admin sees only
-- those of the subscriptions it may use; it is refused (PQ015) by the queue's
-- 'consume' grants, and (PQ014) when it names a consumer it may not use or
-- that is not subscribed.
create or replace function pgque.dead_letters(
    p_queue text, p_consumer text default null, p_limit integer default 100,
    p_after_id bigint default 0)
returns table (dl_id bigint, consumer text, dl_time timestamptz, reason text, ev_id bigint,
               ev_time timestamptz, ev_retry integer, ev_type text, ev_data text,
               ev_extra1 text)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_admin boolean := pgque._dead_letter_access(v_queue, 'list', p_consumer);
    v_role oid := case when not v_admin then pgque._role_id(pgque._caller()) end;
begin
    return query
        select d.dl_id, d.dl_consumer, d.dl_time, d.dl_reason, d.ev_id, d.ev_time, d.ev_retry,
               d.ev_type, d.ev_data, d.ev_extra1
          from pgque.dead_letter d
         where d.dl_queue = v_queue.queue_id
           and (p_consumer is null or d.dl_consumer = p_consumer
                or split_part(d.dl_consumer, '#', 1) = p_consumer)
           and d.dl_id > coalesce(p_after_id, 0)
           and (v_admin or pgque._may_use_dead_letters(v_queue, d.dl_sub, v_role))
         order by d.dl_id
         limit p_limit;
end
$$;

-- pgque.replay_dead_letter(queue, dl_id, as_next): puts a dead letter back
-- into the log for the consumer that dead-lettered it (same ev_id, type,
-- payload and partition key; retry count back to 0) and removes it from dead
-- letters. Returns the ev_id. With as_next, for a slot of a consumer group,
-- it is not appended to the log but made the next event of its key in its
-- slot, before the key's events the slot has not handed out yet
-- (slots/pause.sql, _hold_first); 22023 for a plain consumer's dead letter or
-- one without a partition key, PQ028 while the key's head is handed out. Admins may replay any; another role those of the
-- subscriptions it may use, within the queue's 'consume' grants. Raises
-- PQ015 (the queue's grants), PQ009 if there is no such dead letter, PQ014
-- if the role may not use its consumer, or the subscription that made it is
-- gone (admins only, then), PQ002 (an admin) if no consumer of its name is
-- subscribed. A refusal changes nothing.
create or replace function pgque.replay_dead_letter(p_queue text, p_dl_id bigint,
                                                    p_as_next boolean default false)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_admin boolean := pgque._dead_letter_access(v_queue, 'replay');
    v_dead pgque.dead_letter;
    v_owner integer;
    v record;
begin
    -- Locked first: a concurrent replay of the same dead letter then finds it gone.
    select * into v_dead from pgque.dead_letter d
     where d.dl_queue = v_queue.queue_id and d.dl_id = p_dl_id
       for update;
    if not found then
        raise exception using errcode = 'PQ009',
            message = format('queue %L has no dead letter %s', pgque._name_for_message(p_queue), p_dl_id);
    end if;
    if not v_admin
       and not pgque._may_use_dead_letters(v_queue, v_dead.dl_sub, pgque._role_id(pgque._caller())) then
        perform pgque._refuse_dead_letters(
            v_queue, 'replay', v_dead.dl_consumer,
            not exists (select 1 from pgque.subscription s where s.sub_id = v_dead.dl_sub),
            v_dead.dl_id);
    end if;
    -- The subscription of that name: for a role other than an admin, the one
    -- that made the dead letter (names are unique per queue).
    select sub_id into v_owner from pgque.subscription
     where sub_queue = v_queue.queue_id and sub_consumer = v_dead.dl_consumer;
    if not found then
        raise exception using errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L',
                             pgque._name_for_message(v_dead.dl_consumer), pgque._name_for_message(p_queue));
    end if;
    if p_as_next then
        if position('#' in v_dead.dl_consumer) = 0 or v_dead.ev_extra1 is null then
            raise exception using errcode = '22023',
                message = format('dead letter %s cannot be replayed as the next event of its key: '
                                 '%s', p_dl_id,
                                 case when v_dead.ev_extra1 is null then 'it has no partition key'
                                      else 'it is not a consumer group''s' end);
        end if;
        -- Under the slot's receive lock, as its receive and ack change its keys.
        select * into v from pgque._find_subscription(v_queue, v_dead.dl_consumer, true);
        delete from pgque.dead_letter d where d.dl_id = v_dead.dl_id;
        perform pgque._hold_first(v.sub, v.cur, v_dead);
        return v_dead.ev_id;
    end if;
    delete from pgque.dead_letter d where d.dl_id = v_dead.dl_id;
    execute 'with src as (select $1::bigint as ev_id, $2::timestamptz as ev_time,'
            '                    $3::integer as ev_owner, 0 as ev_retry, $4::text as ev_type,'
            '                    $5::text as ev_data, $6::text as ev_extra1,'
            '                    null::bigint as ev_delayed_id) '
            || pgque._insert_events_sql(v_queue)
      using v_dead.ev_id, v_dead.ev_time, v_owner, v_dead.ev_type, v_dead.ev_data,
            v_dead.ev_extra1;
    perform nextval(v_queue.queue_event_seq);
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);
    end if;
    return v_dead.ev_id;
end
$$;

-- pgque.purge_dead_letters(queue, consumer, dl_ids): deletes dead letters of
-- a queue: the given ids, or all (of the consumer or group, when given) when
-- ids is null. Returns how many. Admins may purge any. Another role purges
-- those of the subscriptions it may use, as dead_letters lists them, within
-- the queue's 'consume' grants: PQ015 otherwise, PQ014 for a consumer named
-- that it may not use or that is not subscribed, and PQ014, purging none,
-- when one of the ids given is a dead letter it may not use (also one whose
-- subscription is gone).
create or replace function pgque.purge_dead_letters(
    p_queue text, p_consumer text default null, p_dl_ids bigint[] default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_admin boolean := pgque._dead_letter_access(v_queue, 'purge', p_consumer);
    v_role oid := case when not v_admin then pgque._role_id(pgque._caller()) end;
    v_dead pgque.dead_letter;
    v_count bigint;
begin
    if not v_admin and p_dl_ids is not null then
        select * into v_dead from pgque.dead_letter d
         where d.dl_queue = v_queue.queue_id and d.dl_id = any(p_dl_ids)
           and (p_consumer is null or d.dl_consumer = p_consumer
                or split_part(d.dl_consumer, '#', 1) = p_consumer)
           and not pgque._may_use_dead_letters(v_queue, d.dl_sub, v_role)
         order by d.dl_id
         limit 1;
        if found then
            perform pgque._refuse_dead_letters(
                v_queue, 'purge', v_dead.dl_consumer,
                not exists (select 1 from pgque.subscription s where s.sub_id = v_dead.dl_sub),
                v_dead.dl_id);
        end if;
    end if;
    delete from pgque.dead_letter d
     where d.dl_queue = v_queue.queue_id
       and (p_consumer is null or d.dl_consumer = p_consumer
            or split_part(d.dl_consumer, '#', 1) = p_consumer)
       and (p_dl_ids is null or d.dl_id = any(p_dl_ids))
       and (v_admin or pgque._may_use_dead_letters(v_queue, d.dl_sub, v_role));
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- pgque._dead_letters_where(queue, consumer, ev_type, key, older_than,
-- reason): the ids of the queue's dead letters that match every filter given
-- (null: any): of the consumer or group (as dead_letters names them), of that
-- type and partition key, dead-lettered longer than older_than ago, whose
-- reason contains reason; only those the caller may use (all for an admin).
-- Refuses as dead_letters does (PQ015, PQ014), and 22023 for a negative
-- older_than. Oldest first.
create or replace function pgque._dead_letters_where(
    p_queue pgque.queue, p_action text, p_consumer text, p_ev_type text, p_key text,
    p_older_than interval, p_reason text)
returns setof bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_admin boolean := pgque._dead_letter_access(p_queue, p_action, p_consumer);
    v_role oid := case when not v_admin then pgque._role_id(pgque._caller()) end;
begin
    if p_older_than < interval '0' then
        raise exception using errcode = '22023', message = 'older_than must not be negative';
    end if;
    return query
        select d.dl_id from pgque.dead_letter d
         where d.dl_queue = p_queue.queue_id
           and (p_consumer is null or d.dl_consumer = p_consumer
                or split_part(d.dl_consumer, '#', 1) = p_consumer)
           and (p_ev_type is null or d.ev_type = p_ev_type)
           and (p_key is null or d.ev_extra1 = p_key)
           and (p_older_than is null or d.dl_time < now() - p_older_than)
           and (p_reason is null or position(p_reason in coalesce(d.dl_reason, '')) > 0)
           and (v_admin or pgque._may_use_dead_letters(p_queue, d.dl_sub, v_role))
         order by d.dl_id;
end
$$;

-- pgque.replay_dead_letters(queue, consumer, ev_type, key, older_than, reason,
-- as_next, dry_run): replays every dead letter that matches the filters
-- (_dead_letters_where; null: any), as replay_dead_letter does, oldest
-- first (with as_next, newest first, so that each key's come back in their
-- order ahead of its later events); with dry_run, only counts them. Returns
-- how many. All or none: a refusal of any (PQ002, PQ028, 22023) replays none.
create or replace function pgque.replay_dead_letters(
    p_queue text, p_consumer text default null, p_ev_type text default null,
    p_key text default null, p_older_than interval default null, p_reason text default null,
    p_as_next boolean default false, p_dry_run boolean default false)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_ids bigint[] := array(select pgque._dead_letters_where(v_queue, 'replay', p_consumer,
                                                             p_ev_type, p_key, p_older_than,
                                                             p_reason));
    v_id bigint;
begin
    if p_dry_run then
        return cardinality(v_ids);
    end if;
    foreach v_id in array case when p_as_next
                               then array(select i from unnest(v_ids) i order by i desc)
                               else v_ids end loop
        perform pgque.replay_dead_letter(p_queue, v_id, p_as_next);
    end loop;
    return cardinality(v_ids);
end
$$;

-- pgque.purge_dead_letters_where(queue, consumer, ev_type, key, older_than,
-- reason, dry_run): deletes every dead letter that matches the filters
-- (_dead_letters_where; null: any); with dry_run, only counts them. Returns
-- how many.
create or replace function pgque.purge_dead_letters_where(
    p_queue text, p_consumer text default null, p_ev_type text default null,
    p_key text default null, p_older_than interval default null, p_reason text default null,
    p_dry_run boolean default false)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_ids bigint[] := array(select pgque._dead_letters_where(v_queue, 'purge', p_consumer,
                                                             p_ev_type, p_key, p_older_than,
                                                             p_reason));
begin
    if not p_dry_run then
        delete from pgque.dead_letter d where d.dl_id = any(v_ids);
    end if;
    return cardinality(v_ids);
end
$$;

-- ===== code/consumers/read.sql =====
-- pgque: reading a batch: the statements that pick its events, and running them.

-- pgque._slot_expr(slots): the routing formula of pgque.slot_of (slots/groups.sql)
-- over an event row's key (ev_extra1), as SQL text with the slot count spelled out as a
-- literal (an index expression cannot hold a parameter). slots is an
-- integer, so no caller text reaches the result.
create or replace function pgque._slot_expr(p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('(case when ev_extra1 is null then 0'
                  ' else (hashtextextended(ev_extra1, 0) %% %s + %s) %% %s end)',
                  p_slots, p_slots, p_slots)
$$;

-- pgque._slot_filter(slots, slot): the condition " and <routing formula of
-- slots> = <slot>" over an event row, or nothing for no slots or a group of
-- one slot (every event is in its one slot). slot is an SQL expression its
-- callers write (a parameter, a column), never caller text.
create or replace function pgque._slot_filter(p_slots integer, p_slot text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when p_slots is null or p_slots = 1 then ''
                else format(' and %s = %s', pgque._slot_expr(p_slots), p_slot) end
$$;

-- pgque.read_request: everything a read of events is given, as one value:
-- the batch's bounds, whose events, which of them, and for which slots. The
-- statements below name its fields (through the SQL expression of the
-- request their caller gives: the batch readers' parameter p_read, or ($1)
-- when run dynamically), so a new field is one edit here and one where it is
-- used. Three reads take one:
--   a batch      one subscription's events (one slot's when slots > 1), in
--                ev_id order, at most max_events, after < ev_id <= upto,
--                only ids when given (_read_rows);
--   a span       the same for the slots span_slots of a group of slots, with
--                the retries of their subscriptions span_subs, at most
--                max_events per slot (_span_rows, receive_slots);
--   a probe      which of span_slots have an event between probe_prevs (each
--                slot's own start) and next (_probe_rows).
create type pgque.read_request as (
    prev_xmax   xid8,          -- the snapshot at the batch's start (its last tick): xmax
    prev_xip    xid8[],        --   and its transactions in progress
    next_xmax   xid8,          -- the snapshot at its end (the next tick): xmax
    next        pg_snapshot,   --   and the whole snapshot
    sub_id      integer,       -- the subscription (a batch): its retries only
    after       bigint,        -- ev_id above this
    upto        bigint,        -- ev_id at most this (null: no bound)
    ids         bigint[],      -- only these ev_ids (null: all)
    slot        integer,       -- the slot (a batch of a slot)
    slots       integer,       -- the group's slot count (null: a plain consumer)
    max_events  integer,       -- at most this many, per slot for a span (null: all)
    span_slots  integer[],     -- a span or a probe: the slots,
    span_subs   integer[],     --   their subscriptions,
    probe_prevs pg_snapshot[], --   and for a probe, each one's start
    probe       boolean        -- a probe
);

-- pgque._dual_filter(slots, in_progress, prev_xmax, sub, slot, req): the part
-- of a read's condition that batches, spans and probes share, over an event
-- table e: one half of the dual filter (see _batch_where), the snapshot
-- req.next (below req.next_xmax), retries owned by subscription sub, and the
-- routing formula of slots equal to slot. prev_xmax, sub, slot and req are
-- SQL expressions written by pgque's statement builders, never caller text.
create or replace function pgque._dual_filter(p_slots integer, p_in_progress boolean,
                                              p_prev_xmax text, p_sub text, p_slot text,
                                              p_req text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when p_in_progress then 'e.ev_txid = x.txid'
                else format('e.ev_txid >= %s and e.ev_txid < %s.next_xmax', p_prev_xmax, p_req) end
           || format(' and pg_visible_in_snapshot(e.ev_txid, %s.next)', p_req)
           || format(' and (e.ev_owner is null or e.ev_owner = %s)', p_sub)
           || pgque._slot_filter(p_slots, p_slot)
$$;

-- pgque._batch_where(req, slots, in_progress): one half of the condition
-- that picks a batch's events from an event table e, as SQL text over the
-- read request req (pgque.read_request). The "dual filter": transactions not
-- visible at the batch's start are those at or above its xmax (the half
-- without in_progress) plus those in progress then, all below its xmax (the
-- half with in_progress, over x.txid, one of req.prev_xip). So the ev_txid
-- index is read for one range and a short list of ids instead of whole
-- tables. The halves are disjoint and are read as two scans, the second one
-- probe per listed id (a lateral subquery behind "offset 0", so that the
-- planner cannot turn it into a hash join over the whole slot; see
-- _read_rows): as one condition, "range or in list", a generic plan of
-- PostgreSQL 15 used the slot index for the slot alone and read every row of
-- the slot in the table. With slots above 1 the routing formula is spelled
-- out with its count as a literal, so the planner can use the tables' slot
-- index (generated/slot_index.sql) and read only the slot's rows. Built from
-- an integer only: no caller text. The batch readers (generated/batch_reader.sql)
-- hold it as static SQL; _run_reader runs it dynamically for a count they lack.
create or replace function pgque._batch_where(p_req text, p_slots integer, p_in_progress boolean)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._dual_filter(p_slots, p_in_progress, p_req || '.prev_xmax', p_req || '.sub_id',
                              p_req || '.slot', p_req)
           || format(' and e.ev_id > %1$s.after'
                     ' and (%1$s.upto is null or e.ev_id <= %1$s.upto)'
                     ' and (%1$s.ids is null or e.ev_id = any(%1$s.ids))', p_req)
$$;

-- pgque._as_array(rows): the statement that collects what the statement
-- rows returns (pgque.event_template's columns) into one array, as the
-- readers' callers take events (_run_reader runs it when a reader lacks the
-- branch), turned into values of the type only once limited, so that a piece
-- of 100 does not build the rows of the whole batch. rows is pgque's own text.
create or replace function pgque._as_array(p_rows text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select array(select row(x.*)::pgque.event_template from (%s) x)', p_rows)
$$;

-- pgque._read_rows(req, queue_id, slots): the statement that reads a batch
-- of the queue for a slot of slots (null: a plain consumer), as rows of
-- pgque.event_template's columns: the events of both halves of
-- _batch_where, each read by its own scan, in ev_id order, at most
-- req.max_events (null: all).
create or replace function pgque._read_rows(p_req text, p_queue_id integer, p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select e.* from pgque.%I e where %s'
                  ' union all'
                  ' select e.* from unnest(%s.prev_xip) as x(txid)'
                  '  cross join lateral (select e.* from pgque.%I e where %s offset 0) e'
                  ' order by ev_id limit %s.max_events',
                  pgque._event_table(p_queue_id), pgque._batch_where(p_req, p_slots, false),
                  p_req,
                  pgque._event_table(p_queue_id), pgque._batch_where(p_req, p_slots, true),
                  p_req)
$$;

-- pgque._span_rows(req, queue_id, slots, limited): the statement that
-- reads a batch of the queue for several slots of a group of slots at once
-- (receive_slots, slots/sets.sql): both halves of the batch's condition as
-- _read_rows has them, for the slots req.span_slots (the routing formula
-- of slots among them) and with the retries of any of their subscriptions
-- req.span_subs, in no particular order (the caller orders what it hands
-- out); with limited, at most req.max_events events per slot, the first by
-- ev_id, as each slot's own read has it, so that pieces of max_events do not
-- read whole batches into memory. As rows of pgque.event_template's columns.
-- Built from integers only.
create or replace function pgque._span_rows(p_req text, p_queue_id integer,
                                            p_slots integer, p_limited boolean)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select x.ev_id, x.ev_time, x.ev_txid, x.ev_owner, x.ev_retry,'
                  '       x.ev_type, x.ev_data, x.ev_extra1, x.ev_delayed_id'
                  ' from (select e.*%s'
                  '         from (select e.* from pgque.%I e where %s'
                  '               union all'
                  '               select e.* from unnest(%s.prev_xip) as x(txid)'
                  '                cross join lateral (select e.* from pgque.%I e where %s'
                  '                                     offset 0) e) e) x%s',
                  case when p_limited
                       then format(', row_number() over (partition by %s order by e.ev_id) as n',
                                   pgque._slot_expr(p_slots)) else '' end,
                  pgque._event_table(p_queue_id),
                  pgque._dual_filter(p_slots, false, p_req || '.prev_xmax',
                                     format('any(%s.span_subs)', p_req),
                                     format('any(%s.span_slots)', p_req), p_req),
                  p_req,
                  pgque._event_table(p_queue_id),
                  pgque._dual_filter(p_slots, true, p_req || '.prev_xmax',
                                     format('any(%s.span_subs)', p_req),
                                     format('any(%s.span_slots)', p_req), p_req),
                  case when p_limited then format(' where x.n <= %s.max_events', p_req) else '' end)
$$;

-- pgque._probe_rows(req, queue_id, slots): the statement that finds which
-- of the slots req.span_slots of slots have an event in their batch up to
-- the snapshot req.next: for each of them (with its subscription of
-- req.span_subs and its start of req.probe_prevs), at most one of its
-- events, found by scans (one per half of the condition) that stop at the
-- first. As rows of pgque.event_template's columns.
create or replace function pgque._probe_rows(p_req text, p_queue_id integer, p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select (p.ev).*'
                  ' from unnest(%1$s.span_slots, %1$s.span_subs, %1$s.probe_prevs) s(k, sub, prev)'
                  ' cross join lateral ((select row(e.*)::pgque.event_template as ev'
                  '                        from pgque.%2$I e where %3$s limit 1)'
                  '                     union all'
                  '                     (select row(e.*)::pgque.event_template'
                  '                        from pg_snapshot_xip(s.prev) as x(txid)'
                  '                       cross join lateral (select e.* from pgque.%2$I e'
                  '                                            where %4$s offset 0) e'
                  '                       limit 1)'
                  '                     limit 1) p',
                  p_req, pgque._event_table(p_queue_id),
                  pgque._dual_filter(p_slots, false, 'pg_snapshot_xmax(s.prev)', 's.sub', 's.k',
                                     p_req),
                  pgque._dual_filter(p_slots, true, 'pg_snapshot_xmax(s.prev)', 's.sub', 's.k',
                                     p_req))
$$;

-- pgque._cover_rows(req, queue_id): the statement that finds whether a
-- committed event of the queue is not covered by the snapshot whose xmax and
-- in-progress list req.prev_xmax and req.prev_xip hold (the ticker's probe,
-- _uncovered_events): at most one such event, by one scan of the ev_txid
-- index from xmax (in ev_txid order: a generic plan, not knowing xmax, took
-- "ev_txid >= xmax" for a third of the table and read all of it) and one
-- probe per listed id. As rows of pgque.event_template's columns. Built from
-- an integer only.
create or replace function pgque._cover_rows(p_req text, p_queue_id integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select x.*'
                  ' from ((select e.* from pgque.%1$I e where e.ev_txid >= %2$s.prev_xmax'
                  '         order by e.ev_txid limit 1)'
                  '       union all'
                  '       (select e.* from unnest(%2$s.prev_xip) as x(txid)'
                  '         cross join lateral (select e.* from pgque.%1$I e'
                  '                              where e.ev_txid = x.txid offset 0) e limit 1)'
                  '       limit 1) x',
                  pgque._event_table(p_queue_id), p_req)
$$;

-- pgque._read_dispatch(req, queue_id, slots): the statements that serve the
-- read request req for slots (a count: the batch readers write one branch of
-- these per count), each returned as rows: the cover probe (a probe of no
-- slots), the probe, the span read (no slot, slots above 1) or the batch read.
create or replace function pgque._read_dispatch(p_req text, p_queue_id integer,
                                                p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(E'if %1$s.probe and %1$s.span_slots is null then\n'
                  '    return query %5$s;\n'
                  '    return;\n'
                  'end if;\n'
                  'if %1$s.probe then\n'
                  '    return query %2$s;\n'
                  '    return;\n'
                  'end if;\n'
                  '%3$s'
                  'return query %4$s;\n'
                  'return;\n',
                  p_req, pgque._probe_rows(p_req, p_queue_id, p_slots),
                  case when p_slots > 1
                       then format(E'if %1$s.slot is null and %1$s.max_events is null then\n'
                                   '    return query %2$s;\n'
                                   '    return;\n'
                                   'end if;\n'
                                   'if %1$s.slot is null then\n'
                                   '    return query %3$s;\n'
                                   '    return;\n'
                                   'end if;\n',
                                   p_req, pgque._span_rows(p_req, p_queue_id, p_slots, false),
                                   pgque._span_rows(p_req, p_queue_id, p_slots, true))
                       else '' end,
                  pgque._read_rows(p_req, p_queue_id, p_slots),
                  pgque._cover_rows(p_req, p_queue_id))
$$;

-- pgque._run_reader(queue_id, req): the events that the read request req
-- asks of the queue (see pgque.read_request), as one array: through the
-- queue's batch reader when it has a branch for req.slots, else as dynamic
-- SQL, the same statement with the request as its one parameter.
create or replace function pgque._run_reader(p_queue_id integer, p_req pgque.read_request)
returns pgque.event_template[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_reader text := 'pgque.' || pgque._batch_reader_name(p_queue_id);
    v_events pgque.event_template[];
    v_slots integer := coalesce(p_req.slots, 1);
begin
    -- A reader missing (dropped by hand; maintenance writes it again) is one
    -- without the branch: the dynamic statement below reads the same.
    if to_regproc(v_reader) is not null then
        execute format('select array(select r from %s($1) r)', v_reader)
           into v_events using p_req;
        -- One row of nulls: the reader has no branch for this slot count (an
        -- event always has an ev_id).
        if not (cardinality(v_events) = 1 and (v_events[1]).ev_id is null) then
            return v_events;
        end if;
    end if;
    execute pgque._as_array(
                case when p_req.probe and p_req.span_slots is null
                          then pgque._cover_rows('($1)', p_queue_id)
                     when p_req.probe then pgque._probe_rows('($1)', p_queue_id, v_slots)
                     when v_slots > 1 and p_req.slot is null
                          then pgque._span_rows('($1)', p_queue_id, v_slots,
                                                p_req.max_events is not null)
                     else pgque._read_rows('($1)', p_queue_id, v_slots) end)
       into v_events using p_req;
    return v_events;
end
$$;

-- pgque._batch_request(sub_id, prev, next, after, upto, max, ids, slot,
--                      slots): the read request (pgque.read_request) for the
-- events of a batch, in ev_id order: those of transactions visible in
-- snapshot next but not in snapshot prev, that are not retries meant for
-- another subscription, with after < ev_id <= upto (upto null: no bound),
-- at most max of them (null: all), only ids when given, and only the hash
-- class slot of slots when slots is given (the condition: _batch_where).
create or replace function pgque._batch_request(
    p_sub_id integer, p_prev pg_snapshot, p_next pg_snapshot,
    p_after bigint, p_upto bigint, p_max integer, p_ids bigint[],
    p_slot integer default null, p_slots integer default null)
returns pgque.read_request
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_req pgque.read_request;
begin
    v_req.prev_xmax := pg_snapshot_xmax(p_prev);
    v_req.prev_xip := array(select pg_snapshot_xip(p_prev));
    v_req.next_xmax := pg_snapshot_xmax(p_next);
    v_req.next := p_next;
    v_req.sub_id := p_sub_id;
    v_req.after := p_after;
    v_req.upto := p_upto;
    v_req.ids := p_ids;
    v_req.slot := p_slot;
    v_req.slots := p_slots;
    v_req.max_events := p_max;
    v_req.probe := false;
    return v_req;
end
$$;

-- pgque._batch_events(queue_id, sub_id, prev, next, after, upto, max, ids,
--                     slot, slots): the events of the batch _batch_request
-- describes, as one array.
create or replace function pgque._batch_events(
    p_queue_id integer, p_sub_id integer, p_prev pg_snapshot, p_next pg_snapshot,
    p_after bigint, p_upto bigint, p_max integer, p_ids bigint[],
    p_slot integer default null, p_slots integer default null)
returns pgque.event_template[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return pgque._run_reader(p_queue_id,
                             pgque._batch_request(p_sub_id, p_prev, p_next, p_after, p_upto,
                                                  p_max, p_ids, p_slot, p_slots));
end
$$;

-- pgque._probe_slots(queue_id, next, slots, probe_slots, subs, prevs): those of
-- probe_slots (slots of a group of slots; null: a plain consumer's 0) whose
-- batch from prevs (the same position: its last tick's snapshot) to the
-- snapshot next holds an event for subs (its subscription), ascending. One
-- statement for all of them, each slot a probe that stops at its first event.
create or replace function pgque._probe_slots(
    p_queue_id integer, p_next pg_snapshot, p_slots integer, p_probe_slots integer[],
    p_subs integer[], p_prevs pg_snapshot[])
returns integer[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_req pgque.read_request;
begin
    v_req.next_xmax := pg_snapshot_xmax(p_next);
    v_req.next := p_next;
    v_req.slots := p_slots;
    v_req.span_slots := p_probe_slots;
    v_req.span_subs := p_subs;
    v_req.probe_prevs := p_prevs;
    v_req.probe := true;
    return (select coalesce(array_agg(distinct case when p_slots is null or p_slots = 1 then 0
                                                    else pgque.slot_of(e.ev_extra1, p_slots) end),
                            '{}')
              from unnest(pgque._run_reader(p_queue_id, v_req)) e);
end
$$;

-- ===== code/consumers/retry.sql =====
-- pgque: retries: nacked events moved back into the log when due.

-- pgque._insert_events_sql(queue): the statement that moves rows of a CTE
-- named "src" into the queue's current event table, keeping ev_id, ev_time,
-- ev_retry, ev_type, ev_data, ev_extra1 (the partition key) and ev_delayed_id,
-- with a new ev_txid (the moving transaction's) and src.ev_owner as the only
-- subscription that sees them.
create or replace function pgque._insert_events_sql(p_queue pgque.queue)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(
        'insert into pgque.%I (ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data, ev_extra1,'
        '                      ev_delayed_id)'
        ' select ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data, ev_extra1, ev_delayed_id'
        '   from src order by ev_id',
        pgque._event_table(p_queue.queue_id, p_queue.queue_cur_table))
$$;

-- pgque._retry_waiting: the retries not moved back into the log yet (the rows
-- of pgque.retry_queue that no row of pgque.retry_moved marks).
create or replace view pgque._retry_waiting as
select r.*
  from pgque.retry_queue r
 where not exists (select from pgque.retry_moved m
                    where m.rm_id = r.rq_id and m.rm_part = r.rq_part);

-- pgque._maint_retry(queue): moves every due retry of the queue back into the
-- log in one statement; returns how many. A retry moved is not deleted: a row
-- of pgque.retry_moved marks it (in its partition, emptied with it by the
-- rotation, rotation.sql), and the mark is what makes it moved, so a
-- concurrent mover's retry (its mark's key taken) is left alone. Bumps the
-- event sequence when it moved any, so the ticker sees pending events and
-- ticks them out promptly.
create or replace function pgque._maint_retry(p_queue pgque.queue)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    execute 'with due as (select r.* from pgque._retry_waiting r'
            '              where r.ev_queue = $1 and r.ev_retry_after <= now()),'
            '     marked as (insert into pgque.retry_moved (rm_id, rm_part)'
            '                select d.rq_id, d.rq_part from due d'
            '                on conflict do nothing returning rm_id, rm_part),'
            '     src as (select d.* from due d'
            '               join marked m on m.rm_id = d.rq_id and m.rm_part = d.rq_part) '
            || pgque._insert_events_sql(p_queue)
      using p_queue.queue_id;
    get diagnostics v_count = row_count;
    if v_count > 0 then
        perform nextval(p_queue.queue_event_seq);
        if p_queue.queue_ticker_asleep then
            perform pgque._wake_ticker(p_queue.queue_id);  -- ticked at once, not at the next poll
        end if;
    end if;
    return v_count;
end
$$;

-- ===== code/consumers/subscription.sql =====
-- pgque: subscriptions (a consumer's cursor over a queue).
--
-- Every subscription sees every event of its queue (fan-out); consumers never
-- block each other. A new subscription starts at the queue's newest tick, so
-- it receives the events committed after that tick.

-- pgque._subscribe(queue, consumer, owner): registers the subscription
-- unless it exists; returns true when it was created. Takes the name as given
-- (callers validate it). A plain consumer gets owner; a slot subscription
-- (its name holds '#') belongs to its group instead and gets the random key
-- of the session lock that owns it.
create or replace function pgque._subscribe(p_queue pgque.queue, p_consumer text,
                                            p_owner oid default null)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tick bigint := (pgque._last_tick(p_queue.queue_id)).tick_id;
    v_slot boolean := position('#' in p_consumer) > 0;
    v_sub_id integer;
begin
    if v_tick is null then
        v_tick := pgque._make_tick(p_queue);
    end if;
    insert into pgque.subscription (sub_queue, sub_consumer, sub_owner, sub_lock_key)
    values (p_queue.queue_id, p_consumer, case when not v_slot then p_owner end,
            case when v_slot then pgque._random_key() end)
    on conflict (sub_queue, sub_consumer) do nothing
    returning sub_id into v_sub_id;
    if v_sub_id is null then
        return false;
    end if;
    -- Its first cursor, with the rotation row held FOR SHARE until this
    -- commits: no rotation copies the cursors before this one is seen.
    insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_part)
    values (v_sub_id, 1, v_tick, pgque._write_part('cursor', true));
    return true;
end
$$;

-- pgque.subscribe(queue, consumer): subscribes a consumer, owned by the
-- calling role; returns true when the subscription is new, false when it
-- already existed (nothing changes). Raises PQ001 (unknown queue), PQ004
-- (invalid consumer name), PQ015 (the queue's 'consume' grants leave the
-- caller out) or PQ014 (the consumer exists and belongs to another role).
create or replace function pgque.subscribe(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue;
    v_sub pgque.subscription;
begin
    perform pgque._check_name('consumer', p_consumer);
    v_queue := pgque._queue_row(p_queue);
    perform pgque._require_queue(v_queue, 'consume');
    if pgque._subscribe(v_queue, p_consumer, pgque._role_id(pgque._caller())) then
        return true;
    end if;
    select * into v_sub from pgque.subscription
     where sub_queue = v_queue.queue_id and sub_consumer = p_consumer;
    perform pgque._require_consumer(v_queue, v_sub.sub_owner, v_sub.sub_grantees, p_consumer);
    return false;
end
$$;

-- pgque._unsubscribe(queue_id, consumers): deletes the subscriptions (retries
-- go by cascade) and their record of handler calls (slots/handling.sql);
-- returns how many. Their cursor rows stay until the next rotations empty
-- their partitions (no row of the cursor log is deleted).
create or replace function pgque._unsubscribe(p_queue_id integer, p_consumers text[])
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_ids integer[];
begin
    with gone as (
        delete from pgque.subscription
         where sub_queue = p_queue_id and sub_consumer = any(p_consumers)
        returning sub_id)
    select array_agg(sub_id) into v_ids from gone;
    delete from pgque.handling where hd_sub = any(v_ids);
    return coalesce(cardinality(v_ids), 0);
end
$$;

-- pgque.unsubscribe(queue, consumer): removes a subscription with its open
-- batch and pending retries; it no longer holds back rotation. Returns false
-- when there was no such subscription. Dead letters are kept. Raises PQ014
-- when the consumer belongs to another role.
create or replace function pgque.unsubscribe(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_sub pgque.subscription;
begin
    if position('#' in p_consumer) > 0 then
        raise exception using errcode = 'PQ021',
            message = format('%L is a slot subscription; use unsubscribe_slots',
                             pgque._name_for_message(p_consumer));
    end if;
    select * into v_sub from pgque.subscription
     where sub_queue = v_queue.queue_id and sub_consumer = p_consumer;
    if not found then
        return false;
    end if;
    perform pgque._require_consumer(v_queue, v_sub.sub_owner, v_sub.sub_grantees, p_consumer);
    return pgque._unsubscribe(v_queue.queue_id, array[p_consumer]) > 0;
end
$$;

-- ===== code/slots/fence.sql =====
-- pgque: fencing epochs for slot owners.
--
-- The slot's advisory lock keeps two sessions from receiving or acking one
-- slot at once, but a handler writing over another connection (or to another
-- system) can outlive the session that owns its slot: a frozen process, a
-- lost network. Epochs fence such a zombie out. When a slot passes to a
-- session, the session's first receive takes a new epoch (pgque.epoch_seq:
-- it only grows) and every batch of that ownership carries it. A handler
-- calls pgque.check_fence(queue, consumer, slot, epoch) in the transaction
-- that writes its effects: it raises PQ026 unless the epoch is the slot's
-- current one and the session that took it still holds the slot.
--
-- The check share-locks the slot's pgque.slot_claim row until the checking
-- transaction ends, and a new epoch is taken by updating that row, so a new
-- owner receives nothing until every transaction that checked the old epoch
-- has ended: writes fenced by epoch e all commit (or fail) before any event is
-- handed out under a later epoch. The new owner does not wait for them (a
-- wait as long as a handler's transaction would look like a dead network to a
-- client's watchdog): while the row is locked, its receive returns nothing,
-- as when no batch is ready, and it tries again at its next poll.

-- Who holds an epoch: the session that took it holds it as an advisory lock,
-- the epoch key (two integers: _epoch_class(slot), the epoch's low 32 bits),
-- taken twice (see slots/keys.sql) when it takes the epoch and released
-- with the slot. So "pid P holds epoch key K and the slot's key" names one
-- session and one ownership: pids are reused, but the key dies with the
-- session, and a release ends it even when the release's transaction rolls
-- back or a checking transaction keeps the epoch's row from being updated.
-- Any session may check it in pg_locks. (0.2 named the session by its
-- backend's start time, which pg_stat_activity hides from roles without
-- pg_read_all_stats, which the database owner who installs pgque usually
-- lacks: every receive then took a new epoch, and no fence passed.)

-- pgque._epoch_class(sub_id): the first integer of a slot's epoch keys: the
-- negated subscription id, never a group's member class (slots/groups.sql,
-- never negative).
create or replace function pgque._epoch_class(p_sub_id integer)
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select -p_sub_id $$;

-- pgque._epoch_number(epoch): the second integer of an epoch's key: its low
-- 32 bits, as a signed integer.
create or replace function pgque._epoch_number(p_epoch bigint)
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select ((p_epoch + 2147483648) % 4294967296 - 2147483648)::integer $$;

-- pgque._drop_epoch_keys(sub_id): releases every epoch key of the slot this
-- session holds (found in pg_locks: a rolled back epoch leaves its key held
-- with no row naming it). Called where an ownership or an epoch ends, not per
-- receive.
create or replace function pgque._drop_epoch_keys(p_sub_id integer)
returns void
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = error
as $$
declare
    v_class integer := pgque._epoch_class(p_sub_id);
    v_number integer;
begin
    for v_number in select n from pgque._own_pair_numbers(v_class) n loop
        while pg_advisory_unlock(v_class, v_number) loop
        end loop;
    end loop;
end
$$;

-- pgque._holds_epoch(pid, sub_id, epoch, key): whether the session pid holds
-- the epoch's key and the slot's key (key) exclusively: on this session's own
-- locks when it is this one (no look at pg_locks), else in pg_locks (one read).
create or replace function pgque._holds_epoch(
    p_pid integer, p_sub_id integer, p_epoch bigint, p_key bigint)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_pid is null or p_epoch is null then
        return false;
    end if;
    if p_pid = pg_backend_pid() then
        return pgque._holds_pair(pgque._epoch_class(p_sub_id), pgque._epoch_number(p_epoch))
           and pgque._holds_key(p_key);
    end if;
    return (select count(*) = 2 from pg_locks l
             where l.locktype = 'advisory' and l.pid = p_pid
               and l.granted and l.mode = 'ExclusiveLock'
               and l.database = (select oid from pg_database where datname = current_database())
               and ((l.objsubid = 2
                     and l.classid = (pgque._epoch_class(p_sub_id)::bigint & 4294967295)::oid
                     and l.objid = (pgque._epoch_number(p_epoch)::bigint & 4294967295)::oid)
                    or (l.objsubid = 1
                        and l.classid = ((p_key >> 32) & 4294967295)::oid
                        and l.objid = (p_key & 4294967295)::oid)));
end
$$;

-- pgque._held_epoch(sub): the slot's current epoch when this session took it
-- in its current ownership of the slot, else null. No wait, no write, no look
-- at pg_locks.
create or replace function pgque._held_epoch(p_sub pgque.subscription)
returns bigint
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_epoch bigint;
begin
    select c.sc_epoch into v_epoch from pgque.slot_claim c
     where c.sc_sub = p_sub.sub_id and c.sc_pid = pg_backend_pid();
    if v_epoch is not null
       and pgque._holds_pair(pgque._epoch_class(p_sub.sub_id), pgque._epoch_number(v_epoch)) then
        return v_epoch;
    end if;
    return null;
end
$$;

-- pgque._slot_epoch(sub): the slot's epoch for this session, which owns the
-- slot: the current one when this session took it (_held_epoch), else a new
-- one, whose key it takes; null while a transaction that checked the old one
-- holds it (see above).
create or replace function pgque._slot_epoch(p_sub pgque.subscription)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_claim pgque.slot_claim;
begin
    v_claim.sc_epoch := pgque._held_epoch(p_sub);
    if v_claim.sc_epoch is not null then
        return v_claim.sc_epoch;  -- the usual case: one look
    end if;
    select * into v_claim from pgque.slot_claim where sc_sub = p_sub.sub_id;
    if found then
        perform 1 from pgque.slot_claim where sc_sub = p_sub.sub_id
            for no key update skip locked;
        if not found then
            return null;  -- held by a checking transaction
        end if;
    end if;
    -- A first row of the slot, or the row locked above. (Two sessions cannot
    -- both get here for one slot: only its owner receives.)
    insert into pgque.slot_claim (sc_sub, sc_epoch, sc_pid)
    values (p_sub.sub_id, nextval('pgque.epoch_seq'), pg_backend_pid())
    on conflict (sc_sub) do update
       set sc_epoch = excluded.sc_epoch, sc_pid = excluded.sc_pid, sc_time = now()
    returning sc_epoch into v_claim.sc_epoch;
    perform pgque._drop_epoch_keys(p_sub.sub_id);  -- an earlier epoch's, rolled back
    perform pg_try_advisory_lock(pgque._epoch_class(p_sub.sub_id),
                                 pgque._epoch_number(v_claim.sc_epoch));
    perform pg_try_advisory_lock(pgque._epoch_class(p_sub.sub_id),
                                 pgque._epoch_number(v_claim.sc_epoch));  -- the second hold
    return v_claim.sc_epoch;
end
$$;

-- pgque._slot_epochs(subs): _slot_epoch for each of subs (slots this session
-- owns), in their order. The usual case, every slot's epoch taken by this
-- session already, is one statement; otherwise slot by slot.
create or replace function pgque._slot_epochs(p_subs pgque.subscription[])
returns bigint[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_epochs bigint[];
begin
    select array_agg(c.sc_epoch order by t.ordinality) into v_epochs
      from unnest(p_subs) with ordinality as t
      join pgque.slot_claim c on c.sc_sub = t.sub_id
     where c.sc_pid = pg_backend_pid()
       and pgque._holds_pair(pgque._epoch_class(c.sc_sub), pgque._epoch_number(c.sc_epoch));
    if cardinality(v_epochs) = cardinality(p_subs) then
        return v_epochs;
    end if;
    return array(select pgque._slot_epoch(p_subs[i]) from generate_subscripts(p_subs, 1) i
                  order by i);
end
$$;

-- pgque._end_epoch(sub): called when this session releases the slot: its
-- epoch ends, so the next claim (even by this session) takes a new one. The
-- epoch's key goes at once, whatever becomes of this transaction; the row is
-- marked released unless a checking transaction holds it (no wait: check_fence
-- refuses the epoch anyway once its key is gone).
create or replace function pgque._end_epoch(p_sub pgque.subscription)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    select pgque._drop_epoch_keys(p_sub.sub_id);
    update pgque.slot_claim c set sc_pid = null, sc_time = now()
     where c.sc_sub = p_sub.sub_id and c.sc_pid = pg_backend_pid()
       and c.sc_sub in (select l.sc_sub from pgque.slot_claim l where l.sc_sub = p_sub.sub_id
                           for no key update skip locked)
$$;

-- pgque.check_fence(queue, consumer, slot, epoch): returns when epoch is the
-- current epoch of slot slot of consumer group consumer and the session that
-- took it still owns the slot; raises PQ026 otherwise (a stale epoch: the
-- slot moved, was released, or its owner's session ended). Call it in the
-- transaction that writes a handler's effects, on any connection: it holds
-- the epoch until that transaction ends (see above). PQ014 for a role that
-- may not use the group; 22023 for a null epoch.
create or replace function pgque.check_fence(
    p_queue text, p_consumer text, p_slot integer, p_epoch bigint)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_claim pgque.slot_claim;
begin
    if p_epoch is null then
        raise exception using errcode = '22023', message = 'the epoch must not be null';
    end if;
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, null, false);
    select * into v_claim from pgque.slot_claim where sc_sub = (v.sub).sub_id for share;
    if not found or v_claim.sc_epoch <> p_epoch then
        raise exception using errcode = 'PQ026',
            message = format('epoch %s of slot %L is stale: the slot''s epoch is now %s',
                             p_epoch, (v.sub).sub_consumer,
                             coalesce(v_claim.sc_epoch::text, 'none')),
            hint = 'The slot passed to another owner: this handler must not write its effects.';
    end if;
    if not pgque._holds_epoch(v_claim.sc_pid, (v.sub).sub_id, v_claim.sc_epoch,
                              (v.sub).sub_lock_key) then
        raise exception using errcode = 'PQ026',
            message = format('epoch %s of slot %L is stale: the session that took it no '
                             'longer owns the slot', p_epoch, (v.sub).sub_consumer),
            hint = 'The owner''s session ended or released the slot: this handler must not '
                   'write its effects.';
    end if;
end
$$;

-- ===== code/slots/groups.sql =====
-- pgque: partitioned consumption (consumer groups split into N slots).
--
-- A consumer group c with N slots is N ordinary subscriptions named
-- "c#k/N" (k = 0..N-1), each with its own cursor, retries and dead letters.
-- Slot k receives only the events whose partition key (ev_extra1) hashes to
-- k: slot(K) = (hashtextextended(K, 0) % N + N) % N, NULL key -> slot 0.
-- N is persisted per (queue, consumer) on first use and enforced.
--
-- Ownership: a worker claims slot k with a session advisory lock whose key
-- pgque.slot_lock_key() gives. Receive, ack and nack of a slot refuse unless
-- the calling session holds that lock, so a worker whose session died (and
-- with it the lock) can never ack a batch another worker now owns.
--
-- Keys: every slot has its own random key, stored with it, so no role can
-- take a slot's lock before a worker does. pg_locks shows held keys to
-- everyone, though, and advisory locks need no privilege: a role without
-- rights on the consumer could wait on a key it saw and get the lock when its
-- worker goes. So a session counts as owner or member only if its role may
-- use the consumer (_may_consume), and a claim that finds a slot's key held
-- or awaited only by sessions that do not count renews the key (a new random
-- value) and takes the new one. Checks of a lock this session holds never
-- release it (slots/keys.sql), so a session waiting on a held key waits
-- until its holder lets go.
--
-- Membership: each member of a group holds a lock of its own, the
-- two-integer advisory key (the group's class, a random member number),
-- exclusively. No member ever waits for or blocks another, and a session
-- queued on a member's key blocks nobody's join: a joiner draws another
-- number. (One shared key for all members, as in 0.2, let any session queued
-- on it exclusively refuse every later join, and the renewal that got round
-- that dropped the members already there.)
--
-- Errors (see pgque/errors.py): PQ020 to PQ024; PQ026 in slots/fence.sql.

-- pgque.max_slots(): the largest slot count a group may have.
create or replace function pgque.max_slots()
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select 1024 $$;

-- pgque.slot_of(key, slots): the slot a partition key routes to. This is
-- the one definition of routing; the receive filter (_slot_expr), the
-- routing of receive_slots (slots/sets.sql) and the info functions write
-- the same formula inline, since a function with a pinned search_path is
-- never inlined and would cost a call per event row. tests/test_routing.py
-- pins the formula; tests/test_slot_sets_model.py compares receive_slots'
-- routing with the receive filter's.
create or replace function pgque.slot_of(p_key text, p_slots integer)
returns integer
language sql immutable parallel safe
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select case when p_key is null then 0
                else ((hashtextextended(p_key, 0) % p_slots + p_slots) % p_slots)::integer end
$$;

-- pgque._slot_name(consumer, k, n): the slot subscription's consumer name.
create or replace function pgque._slot_name(p_consumer text, p_slot integer, p_slots integer)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return p_consumer || '#' || p_slot::text || '/' || p_slots::text;
end
$$;

-- pgque._check_slot(k, n): PQ022 unless 1 <= n <= max_slots(); PQ023 unless
-- 0 <= k < n.
create or replace function pgque._check_slot(p_slot integer, p_slots integer)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_slots is null or p_slots < 1 or p_slots > pgque.max_slots() then
        raise exception using errcode = 'PQ022',
            message = format('slot count must be from 1 to %s, not %s', pgque.max_slots(), p_slots);
    end if;
    if p_slot is null or p_slot < 0 or p_slot >= p_slots then
        raise exception using errcode = 'PQ023',
            message = format('slot must be from 0 to %s, not %s', p_slots - 1, p_slot);
    end if;
end
$$;

-- pgque._group(queue, consumer, slots): the group row, checking that the
-- caller may use the group (PQ014, PQ015) and that slots equals its persisted
-- count (PQ020); PQ002 when the group does not exist.
create or replace function pgque._group(p_queue pgque.queue, p_consumer text, p_slots integer)
returns pgque.consumer_group
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_group pgque.consumer_group;
begin
    select * into v_group from pgque.consumer_group
     where cg_queue = p_queue.queue_id and cg_consumer = p_consumer;
    if not found then
        raise exception using errcode = 'PQ002',
            message = format('consumer group %L is not subscribed to queue %L',
                             pgque._name_for_message(p_consumer), p_queue.queue_name);
    end if;
    perform pgque._require_consumer(p_queue, v_group.cg_owner, v_group.cg_grantees, p_consumer);
    if p_slots is not null and v_group.cg_slots <> p_slots then
        raise exception using errcode = 'PQ020',
            message = format('consumer group %L of queue %L has %s slots, not %s',
                             pgque._name_for_message(p_consumer), p_queue.queue_name, v_group.cg_slots, p_slots),
            hint = 'The slot count is fixed per group: a different one would move keys between '
                   'slots and break per-key order. Unsubscribe the group to change it.';
    end if;
    return v_group;
end
$$;

-- pgque._new_group_key(): a random key for a new group whose member class
-- (_member_class) no other group of the database has, so that no group counts
-- another's members.
create or replace function pgque._new_group_key()
returns bigint
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key bigint;
begin
    loop
        v_key := pgque._random_key();
        exit when not exists (select 1 from pgque.consumer_group g
                               where g.cg_lock_key & 2147483647 = v_key & 2147483647);
    end loop;
    return v_key;
end
$$;

-- pgque._ensure_group(queue, consumer, slot, slots): validates the name, the
-- slot and the count, and registers the group, owned by the caller, with its
-- count and a random membership key unless it exists; returns the group row
-- (PQ020 if it exists with another count, PQ014 if it belongs to a role the
-- caller may not act for). It touches no event table: maintenance gives them
-- the index for a new slot count (generated/slot_index.sql), in a transaction of its
-- own, so a subscribe inside a long transaction holds no producer.
create or replace function pgque._ensure_group(
    p_queue pgque.queue, p_consumer text, p_slot integer, p_slots integer)
returns pgque.consumer_group
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pgque._check_name('consumer', p_consumer);
    perform pgque._check_slot(p_slot, p_slots);
    perform pgque._require_queue(p_queue, 'consume');
    insert into pgque.consumer_group (cg_queue, cg_consumer, cg_slots, cg_owner, cg_lock_key)
    values (p_queue.queue_id, p_consumer, p_slots, pgque._role_id(pgque._caller()),
            pgque._new_group_key())
    on conflict (cg_queue, cg_consumer) do nothing;
    return pgque._group(p_queue, p_consumer, p_slots);
end
$$;

-- pgque.subscribe_slots(queue, consumer, slots, policy): subscribes consumer
-- group consumer with slots slots (all of them), owned by the caller,
-- persisting the count; with policy, sets its failure policy
-- (set_failure_policy, with its default bounds) unless it has that one. Idempotent for the same count; returns how many slot
-- subscriptions were new. Raises PQ020 if the group exists with another
-- count, PQ022 for a bad count, PQ004 for a bad name, PQ014 if the group
-- belongs to another role, PQ015 if the queue's grants leave the caller out.
create or replace function pgque.subscribe_slots(p_queue text, p_consumer text, p_slots integer,
                                                 p_policy text default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_new integer := 0;
    k integer;
begin
    v_group := pgque._ensure_group(v_queue, p_consumer, 0, p_slots);
    if p_policy is not null and p_policy is distinct from v_group.cg_policy then
        -- With the bounds set_failure_policy gives by default.
        perform pgque._set_policy(v_queue, v_group, p_policy, 10, interval '1 hour',
                                  v_group.cg_max_retries);
    end if;
    for k in 0 .. p_slots - 1 loop
        if pgque._subscribe(v_queue, pgque._slot_name(p_consumer, k, p_slots)) then
            v_new := v_new + 1;
        end if;
    end loop;
    return v_new;
end
$$;

-- pgque.subscribe_slot(queue, consumer, slot, slots): subscribes one slot
-- of the group (persisting the count on first use); true when new. Same
-- errors as subscribe_slots, plus PQ023 for a bad slot.
create or replace function pgque.subscribe_slot(
    p_queue text, p_consumer text, p_slot integer, p_slots integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    perform pgque._ensure_group(v_queue, p_consumer, p_slot, p_slots);
    return pgque._subscribe(v_queue, pgque._slot_name(p_consumer, p_slot, p_slots));
end
$$;

-- pgque.unsubscribe_slots(queue, consumer): removes a consumer group with all
-- its slot subscriptions (their cursors, open batches and retries); the
-- group may then be subscribed again with another slot count. Returns how
-- many slot subscriptions were removed. Maintenance drops the slot index of
-- its count once no other group of the queue has that count.
create or replace function pgque.unsubscribe_slots(p_queue text, p_consumer text)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
    v_count integer;
begin
    v_count := pgque._unsubscribe(
        v_queue.queue_id,
        array(select pgque._slot_name(p_consumer, k, v_group.cg_slots)
                from generate_series(0, v_group.cg_slots - 1) k));
    delete from pgque.consumer_group where cg_id = v_group.cg_id;
    return v_count;
end
$$;

-- pgque._slot_sub(queue, consumer, slot, slots, lock): the slot's queue,
-- group and subscription rows and cursor, each looked up once, after
-- validating slot and slots (null: the group's), the persisted count and the
-- caller's access to the group. Callers filter by grp.cg_slots, never by the
-- slots they were given: a null count means the group's, not "no filter".
create or replace function pgque._slot_sub(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_lock boolean,
    out queue pgque.queue, out grp pgque.consumer_group, out sub pgque.subscription,
    out cur pgque.cursor)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    if p_slots is not null then
        perform pgque._check_slot(p_slot, p_slots);
    end if;
    queue := pgque._queue_row(p_queue);
    grp := pgque._group(queue, p_consumer, p_slots);
    if p_slots is null then
        -- The slot functions that take only a slot number: the group's count.
        perform pgque._check_slot(p_slot, grp.cg_slots);
    end if;
    select * into v
      from pgque._find_subscription(
               queue, pgque._slot_name(p_consumer, p_slot, coalesce(p_slots, grp.cg_slots)),
               p_lock);
    sub := v.sub;
    cur := v.cur;
end
$$;

-- pgque._check_slot_list(group, slots): 22023 for a null list or a slot named
-- twice, PQ023 for a slot that is not one of the group's.
create or replace function pgque._check_slot_list(p_group pgque.consumer_group,
                                                  p_slots integer[])
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_slot integer;
begin
    if p_slots is null then
        raise exception using errcode = '22023', message = 'the list of slots must not be null';
    end if;
    -- One look at them all; the slot at fault, for the message, only then.
    if exists (select from unnest(p_slots) k where k is null or k < 0 or k >= p_group.cg_slots) then
        foreach v_slot in array p_slots loop
            perform pgque._check_slot(v_slot, p_group.cg_slots);
        end loop;
    end if;
    if cardinality(p_slots) <> (select count(distinct k) from unnest(p_slots) k) then
        raise exception using errcode = '22023',
            message = format('slots %s name a slot twice', p_slots::text);
    end if;
end
$$;

-- pgque._slot_subs(queue, group, slots): the subscriptions and newest cursors
-- of the given slots of the group (checked by _check_slot_list), ascending
-- by slot, in one statement read without a lock; PQ002 for a slot that is
-- not subscribed (a group made slot by slot with subscribe_slot). A cursor
-- is null when this statement's snapshot is older than the rotation that
-- emptied the partition it names: callers that lock the slots read theirs
-- again once locked.
create or replace function pgque._slot_subs(
    p_queue pgque.queue, p_group pgque.consumer_group, p_slots integer[])
returns table (slot integer, sub pgque.subscription, cur pgque.cursor)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_parts record := pgque._cursor_parts();
    v_found integer;
    v_missing integer;
begin
    perform pgque._check_slot_list(p_group, p_slots);
    return query
        select k, s, coalesce(c1.c, c2.c)
          from unnest(p_slots) k
          -- _slot_name, written out: a call per slot cost more than the join.
          join pgque.subscription s
            on s.sub_queue = p_queue.queue_id
           and s.sub_consumer = p_group.cg_consumer || '#' || k::text || '/'
                                || p_group.cg_slots::text
         -- pgque._current_cursor, written out: a call per slot cost more than its
         -- read. (Null when a rotation emptied its partition after this
         -- statement's snapshot: the callers read it again once locked.)
         left join lateral (select o from pgque.cursor o
                             where o.cur_part = v_parts.part and o.cur_sub = s.sub_id
                             order by o.cur_seq desc limit 1) c1(c) on true
         -- During a switch, a slot not moved yet: in the partition left.
         left join lateral (select o from pgque.cursor o
                             where c1.c is null and o.cur_part = v_parts.moved_from
                               and o.cur_sub = s.sub_id
                             order by o.cur_seq desc limit 1) c2(c) on true
         order by k;
    get diagnostics v_found = row_count;
    if v_found < cardinality(p_slots) then
        select min(k) into v_missing
          from unnest(p_slots) k
         where not exists (select from pgque.subscription s
                            where s.sub_queue = p_queue.queue_id
                              and s.sub_consumer = pgque._slot_name(p_group.cg_consumer, k,
                                                                    p_group.cg_slots));
        raise exception using errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L',
                             pgque._name_for_message(
                                 pgque._slot_name(p_group.cg_consumer, v_missing,
                                                  p_group.cg_slots)),
                             p_queue.queue_name);
    end if;
end
$$;

-- pgque._member_class(group): the first integer of the group's member keys:
-- 31 random bits of its key (cg_lock_key), so that pg_locks shows it as the
-- same non-negative number (classid); no two groups of the database share it
-- (_new_group_key; groups made before 0.3 do with odds of 2^-31 a pair).
create or replace function pgque._member_class(p_group pgque.consumer_group)
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select (p_group.cg_lock_key & 2147483647)::integer $$;

-- pgque.join_group(queue, consumer): registers this session as a live
-- member of the group, with a session advisory lock on a member key of its
-- own (see the top of this file), so workers can count each other (see
-- group_status) and share slots fairly. Never waits. The session remembers
-- its member number in a setting (pgque.member_<group id>), and finds it in
-- pg_locks when a rollback or RESET lost the setting. True when this session
-- joined now, false when it was a member already; PQ014 unless its login role
-- may use the group.
create or replace function pgque.join_group(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
    v_class integer := pgque._member_class(v_group);
    v_setting text := 'pgque.member_' || v_group.cg_id;
    v_member integer := nullif(current_setting(v_setting, true), '')::integer;
begin
    perform pgque._require_counting_session(v_queue, v_group);
    if v_member is not null and pgque._holds_pair(v_class, v_member) then
        return false;
    end if;
    -- The setting was rolled back (or RESET) while the lock stayed: a member
    -- already. Drawing a new number would leave a lock behind for each rollback.
    v_member := (select n from pgque._own_pair_numbers(v_class) n limit 1);
    if v_member is not null then
        perform set_config(v_setting, v_member::text, false);
        return false;
    end if;
    loop
        -- A number held or awaited by another session is refused at once:
        -- draw another (2^32 of them).
        v_member := (pgque._random_key() & 4294967295) - 2147483648;
        exit when pg_try_advisory_lock(v_class, v_member);
    end loop;
    perform pg_try_advisory_lock(v_class, v_member);  -- the second hold: granted at once
    perform set_config(v_setting, v_member::text, false);
    return true;
end
$$;

-- pgque.group_status(queue, consumer): the group now, in one row: the number
-- of live members (sessions that joined the group), this session's rank among
-- them by backend pid (0-based; null if not a member), this session's pid,
-- and the owner of each slot (owner_pids[k + 1] is slot k's owner backend pid,
-- null when unowned). A member's fair share is members' integer share of the
-- slots, plus one for the first (slots % members) ranks, so the shares always
-- add up to slots. Only sessions whose roles may use the group count, as
-- owners or members: a slot whose key another role sits on shows as unowned,
-- so a worker claims it (and claim_slot renews the key).
create or replace function pgque.group_status(
    p_queue text, p_consumer text,
    out members integer, out my_rank integer, out my_pid integer, out owner_pids integer[])
language plpgsql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
begin
    perform pg_stat_clear_snapshot();  -- see _key_sessions
    with keys as materialized (
        -- The slots' keys, one per slot.
        select n as key_slot, s.sub_lock_key as key
          from generate_series(0, v_group.cg_slots - 1) n
          join pgque.subscription s
            on s.sub_queue = v_queue.queue_id
           and s.sub_consumer = pgque._slot_name(p_consumer, n, v_group.cg_slots)),
    locks as materialized (
        -- Advisory locks are per database, but pg_locks shows the whole
        -- cluster: without the database, another one's locks would count.
        -- objsubid 1: a bigint key; 2: a two-integer key (a member's).
        select l.classid, l.objid, l.objsubid, l.pid from pg_locks l
         where l.locktype = 'advisory' and l.granted and l.mode = 'ExclusiveLock'
           and l.database = (select oid from pg_database where datname = current_database())),
    holders as materialized (
        -- The slots' owners, then the members (slot null).
        select h.key_slot, h.pid
          from (select keys.key_slot, locks.pid
                  from keys
                  join locks on locks.objsubid = 1
                            and locks.classid = ((keys.key >> 32) & 4294967295)::oid
                            and locks.objid = (keys.key & 4294967295)::oid
                union all
                select null, locks.pid from locks
                 where locks.objsubid = 2
                   and locks.classid = pgque._member_class(v_group)::oid) h
          join pg_stat_activity a on a.pid = h.pid
         where pgque._may_consume(a.usesysid, v_queue, v_group.cg_owner, v_group.cg_grantees)),
    member_pids as (
        select array_agg(distinct h.pid order by h.pid) as pids from holders h
         where h.key_slot is null)
    select coalesce(cardinality(m.pids), 0),
           array_position(m.pids, pg_backend_pid()) - 1,
           pg_backend_pid(),
           (select array_agg(o.pid order by n)
              from generate_series(0, v_group.cg_slots - 1) n
              left join holders o on o.key_slot = n)
      into members, my_rank, my_pid, owner_pids
      from member_pids m;
end
$$;

-- pgque.pending_slots(queue, consumer): the slots of the group (ascending)
-- whose receive_partitioned may return a batch now: those with an open batch,
-- and those with an event of their hash class committed after their cursor's
-- last tick and covered by the queue's newest tick. A hint for waking
-- workers, not a promise: a slot that receives after the answer may find the
-- event taken by a retry's owner filter or a newer tick, and a slot left out
-- is found by its next poll. Each slot is one probe through the queue's
-- batch reader (generated/batch_reader.sql) and its slot index (generated/slot_index.sql),
-- which stops at the first event found. Read-only; refused (PQ014) to roles that may not use the group.
create or replace function pgque.pending_slots(p_queue text, p_consumer text)
returns integer[]
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
-- The control of every Worker asks this at each tick: planned once per
-- session rather than per call (measured: 0.45 against 0.2 ms at N = 8).
set plan_cache_mode = force_generic_plan
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
    v_newest pgque.tick := pgque._last_tick(v_queue.queue_id);
    v_open integer[];
    v_slots integer[];
    v_subs integer[];
    v_prevs pg_snapshot[];
begin
    if v_newest.tick_id is null then
        return '{}';
    end if;
    -- The slots with an open batch, and the others with their subscription
    -- and the snapshot of their last tick, for one probe of them all.
    select coalesce(array_agg(x.slot order by x.slot)
                        filter (where (x.cur).cur_batch is not null), '{}'),
           array_agg(x.slot order by x.slot) filter (where (x.cur).cur_batch is null),
           array_agg((x.sub).sub_id order by x.slot) filter (where (x.cur).cur_batch is null),
           array_agg(t.tick_snapshot order by x.slot) filter (where (x.cur).cur_batch is null)
      into v_open, v_slots, v_subs, v_prevs
      from pgque._slot_subs(v_queue, v_group,
                            array(select generate_series(0, v_group.cg_slots - 1))) x
      join pgque.tick t on t.tick_queue = v_queue.queue_id and t.tick_id = (x.cur).cur_last_tick;
    if v_slots is not null then
        v_open := array(select unnest(v_open || pgque._probe_slots(v_queue.queue_id,
                                                                   v_newest.tick_snapshot,
                                                                   v_group.cg_slots, v_slots,
                                                                   v_subs, v_prevs))
                        order by 1);
    end if;
    return v_open;
end
$$;

-- pgque._group_subs(group): the group's slots and their subscriptions (slots
-- a group made slot by slot may lack), ascending by slot.
create or replace function pgque._group_subs(p_group pgque.consumer_group)
returns table (slot integer, sub_id integer)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select k, s.sub_id
      from generate_series(0, p_group.cg_slots - 1) k
      -- _slot_name, written out (as in _slot_subs)
      join pgque.subscription s
        on s.sub_queue = p_group.cg_queue
       and s.sub_consumer = p_group.cg_consumer || '#' || k::text || '/' || p_group.cg_slots::text
     order by k
$$;

-- pgque._group_positions(queue, group): where the group's slots are: their
-- slots and subscriptions ascending by slot (_group_subs), the snapshots of
-- their last finished ticks (an event is consumed by its slot once visible in
-- it) and the lowest xmin of those (below it, every slot has consumed
-- everything). Nulls for a group without slots. For the reads of a group's
-- pending window (key_lag) and of what it passed (verify_handling).
create or replace function pgque._group_positions(
    p_queue pgque.queue, p_group pgque.consumer_group,
    out slots integer[], out subs integer[], out snaps pg_snapshot[], out floor xid8)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select array_agg(g.slot order by g.slot), array_agg(g.sub_id order by g.slot),
           array_agg(t.tick_snapshot order by g.slot), min(pg_snapshot_xmin(t.tick_snapshot))
      from pgque._group_subs(p_group) g
      cross join lateral pgque._current_cursor(g.sub_id) c
      join pgque.tick t on t.tick_queue = p_queue.queue_id and t.tick_id = c.cur_last_tick
$$;

-- ===== code/slots/handling.sql =====
-- pgque: the record of handler calls, for `pgque verify` (info/verify.sql).
--
-- A Worker started with record=True writes, before it acks a piece of a
-- slot's batch, one row per handler call of that piece into pgque.handling:
-- the event, the slot, the epoch it was received under, the worker, when the
-- call started and ended (the worker's clock) and how it ended. Written before
-- the ack, in a transaction of its own: a worker that dies after the record
-- and before the ack has its events handled again (and recorded again), so an
-- acked event always has its record; a worker whose ack is refused (it lost
-- its slot) has its calls on record all the same, which is what shows an
-- overlap. The verifier reads the record against the log and the cursors.

-- pgque.start_recording(queue, consumer, slots): marks the group as recorded
-- from now on, unless it already is (then keeps the earlier start); returns
-- that start. The verifier checks the events sent since. PQ001, PQ002, PQ014,
-- PQ015, PQ020 as for a receive.
create or replace function pgque.start_recording(p_queue text, p_consumer text, p_slots integer)
returns timestamptz
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_group pgque.consumer_group;
    v_since timestamptz;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(pgque._queue_row(p_queue), p_consumer, p_slots);
    if v_group.cg_recorded_since is not null then
        return v_group.cg_recorded_since;  -- no write: a worker's every start asks
    end if;
    update pgque.consumer_group g set cg_recorded_since = coalesce(g.cg_recorded_since, now())
     where g.cg_id = v_group.cg_id
    returning g.cg_recorded_since into v_since;
    return v_since;
end
$$;

-- pgque.record_handling(queue, consumer, slots, worker, calls): appends the
-- handler calls of calls, a JSON array of arrays [slot, ev_id, batch, retry,
-- key, epoch, started, ended, outcome], to the group's record: the call of the
-- handler of event ev_id (of batch batch, received with retry count retry,
-- partition key key or null, under epoch epoch or null) in slot slot by the
-- worker named worker, from started to ended (seconds since 1970-01-01 UTC),
-- its outcome "ok" (returned), "failed" (raised: nacked) or "dead" (raised,
-- not retryable). Returns how many calls. Does not ask for the slots'
-- ownership: a worker that lost a slot records its calls too. A group whose
-- record was forgotten while its workers ran starts a new record here, as
-- start_recording would, so their calls from then on can be verified. Raises 22023
-- for calls that are not an array of such arrays (a value missing or null
-- where one is due, an unknown outcome, a call that ends before it starts) or
-- a worker name over 200 characters; 22P02 for a value of the wrong type;
-- PQ023 for a slot out of range, PQ002 for one the group lacks; PQ012 for a
-- key over 512 bytes; PQ001, PQ014, PQ015, PQ020 as for a receive. Nothing is
-- written then. (JSON, not an array per column: the client encodes it in
-- microseconds, where psycopg's adapting of nine arrays took longer than the
-- insert.)
create or replace function pgque.record_handling(
    p_queue text, p_consumer text, p_slots integer, p_worker text, p_calls jsonb)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_subs integer[];  -- the slots' subscriptions, by slot + 1
    v_bad record;
    v_written integer;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    if p_worker is null or length(p_worker) > 200 then
        raise exception using errcode = '22023',
            message = 'record_handling: the worker name must be given, at most 200 characters';
    end if;
    if v_group.cg_recorded_since is null then  -- forgotten meanwhile (rare: one update)
        update pgque.consumer_group g set cg_recorded_since = coalesce(g.cg_recorded_since, now())
         where g.cg_id = v_group.cg_id;
    end if;
    if jsonb_typeof(p_calls) is distinct from 'array' then
        raise exception using errcode = '22023',
            message = 'record_handling: calls must be a JSON array of arrays of nine values';
    end if;
    v_subs := array(select s.sub_id from generate_series(0, v_group.cg_slots - 1) k
                      -- _slot_name, written out (as in _slot_subs)
                      left join pgque.subscription s
                        on s.sub_queue = v_queue.queue_id
                       and s.sub_consumer = v_group.cg_consumer || '#' || k::text || '/'
                                            || v_group.cg_slots::text
                     order by k);
    -- The calls in one statement: a call that is not one (a null, an unknown
    -- outcome, a slot out of range or missing, an end before its start, a
    -- key too long) breaks a constraint of the table, and a second look then
    -- finds which, for the message.
    begin
        insert into pgque.handling (hd_sub, hd_ev_id, hd_batch, hd_retry, hd_key, hd_epoch,
                                    hd_worker, hd_started, hd_ended, hd_outcome)
        select v_subs[r.slot + 1], r.ev_id, r.batch, r.retry, r.key, r.epoch, p_worker,
               r.started, r.ended,
               case r.outcome when 'ok' then 'o' when 'failed' then 'f' when 'dead' then 'd'
               end::"char"
          from pgque._handling_calls(p_calls) r;
        get diagnostics v_written = row_count;
    exception when not_null_violation or check_violation then
        select r.i, r.slot, r.key into v_bad
          from pgque._handling_calls(p_calls) r
         where r.slot is not null
           and (r.slot < 0 or r.slot >= v_group.cg_slots or v_subs[r.slot + 1] is null
                or octet_length(r.key) > 512)
         order by r.i limit 1;
        if v_bad.i is not null then
            perform pgque._check_slot(v_bad.slot, v_group.cg_slots);  -- PQ023
            perform pgque._check_keys(array[v_bad.key]);  -- PQ012
            raise exception using errcode = 'PQ002',
                message = format('consumer group %L of queue %L has no slot %s',
                                 pgque._name_for_message(p_consumer), v_queue.queue_name,
                                 v_bad.slot);
        end if;
        raise exception using errcode = '22023',
            message = 'record_handling: a call has a null, ends before it starts, '
                      'or has an outcome other than ok, failed or dead';
    end;
    return v_written;
end
$$;

-- pgque._handling_calls(calls): the calls of record_handling's JSON as rows,
-- numbered from 1 (i); a call that is not an array of nine values has a null
-- slot, and a time that is not a finite number of seconds within some 30,000
-- years of 1970 (NaN, Infinity) is null (record_handling refuses nulls).
create or replace function pgque._handling_calls(p_calls jsonb)
returns table (i bigint, slot integer, ev_id bigint, batch bigint, retry integer, key text,
               epoch bigint, started timestamptz, ended timestamptz, outcome text)
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select c.i, case when pg_catalog.jsonb_array_length(c.v) = 9 then (c.v->>0)::integer end, (c.v->>1)::bigint, (c.v->>2)::bigint, (c.v->>3)::integer,
           c.v->>4, (c.v->>5)::bigint,
           case when t.started > -1e12 and t.started < 1e12
                then pg_catalog.to_timestamp(t.started) end,
           case when t.ended > -1e12 and t.ended < 1e12
                then pg_catalog.to_timestamp(t.ended) end,
           c.v->>8
      from pg_catalog.jsonb_array_elements(p_calls) with ordinality as c(v, i)
     cross join lateral (select (c.v->>6)::float8 as started, (c.v->>7)::float8 as ended) t
$$;

-- pgque.forget_handling(queue, consumer, slots): deletes the group's record
-- and its start (the next start_recording begins anew); returns how many
-- calls it deleted. Errors as start_recording's.
create or replace function pgque.forget_handling(p_queue text, p_consumer text, p_slots integer)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_deleted bigint;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    delete from pgque.handling h
     where h.hd_sub = any(array(select g.sub_id from pgque._group_subs(v_group) g));
    get diagnostics v_deleted = row_count;
    update pgque.consumer_group set cg_recorded_since = null
     where cg_id = v_group.cg_id and cg_recorded_since is not null;
    return v_deleted;
end
$$;

-- ===== code/slots/keys.sql =====
-- pgque: session advisory lock keys.
--
-- Slot ownership and the ticker election are exclusive session advisory
-- locks on random bigint keys stored in pgque's tables (see slots/groups.sql
-- and ticker/election.sql; group membership, which uses keys of two integers, is
-- there too). These helpers take, check and release such keys and find who
-- holds one. pg_locks shows a bigint key k as classid = high 32 bits, objid
-- = low 32 bits, objsubid = 1.

-- Every key pgque takes, it takes twice (_take_key here; member keys in
-- slots/groups.sql, epoch keys in slots/fence.sql): a session lock is
-- re-entrant, and while a session holds a key more than once, giving one hold
-- back and taking it again is bookkeeping in the session's own memory that
-- never reaches the server's lock table. That is what lets _holds_key ask the
-- lock manager without ever releasing the key: a release that reached the
-- lock table would grant the key at once to any session waiting on it, and
-- pg_locks shows held keys to every role.

-- pgque._holds_key(key): whether this session holds the bigint advisory lock
-- key exclusively at session level (a shared hold is not ownership: two
-- share holders would both pass).
--
-- It gives one hold back and takes it again: the release succeeds exactly
-- when the session holds the key, and with pgque's two holds both steps stay
-- in the session's memory (see above), so no waiter gets the key in between
-- and the answer costs no look at the server's lock table (pg_locks copies
-- all of it, ~0.3 ms, on every receive and ack). A key held once only (taken
-- by hand, or by pgque 0.2 before an upgrade) is released and taken again
-- for real: another session may get it in between, and the answer is then
-- false, the truth, never the reverse. The release warns when there is no
-- hold, hence the client_min_messages. A transaction-level hold
-- (pg_advisory_xact_lock) is not ownership: claims take session locks.
create or replace function pgque._holds_key(p_key bigint)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = error
as $$
begin
    -- Two statements, not one AND: SQL does not promise to evaluate the
    -- release first, nor to skip the take when the release finds no hold.
    if not pg_advisory_unlock(p_key) then
        return false;
    end if;
    return pg_try_advisory_lock(p_key);
end
$$;

-- pgque._holds_pair(key1, key2): _holds_key for a two-integer key (a group
-- member's, slots/groups.sql, or an epoch's, slots/fence.sql).
create or replace function pgque._holds_pair(p_key1 integer, p_key2 integer)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = error
as $$
begin
    if not pg_advisory_unlock(p_key1, p_key2) then
        return false;
    end if;
    return pg_try_advisory_lock(p_key1, p_key2);
end
$$;

-- pgque._own_pair_numbers(key1): the second integers of the two-integer
-- advisory keys (key1, n) this session holds exclusively in this database,
-- signed as the advisory functions take them (pg_locks shows them unsigned).
-- One read of pg_locks: for the rare paths that must find a key whose setting
-- a rollback lost (slots/groups.sql, slots/fence.sql), never per receive.
create or replace function pgque._own_pair_numbers(p_key1 integer)
returns setof integer
language sql volatile
set search_path = pg_catalog, pg_temp
as $$
    select ((l.objid::bigint + 2147483648) % 4294967296 - 2147483648)::integer
      from pg_locks l
     where l.locktype = 'advisory' and l.objsubid = 2 and l.pid = pg_backend_pid()
       and l.granted and l.mode = 'ExclusiveLock'
       and l.classid = (p_key1::bigint & 4294967295)::oid
       and l.database = (select oid from pg_database where datname = current_database())
$$;

-- pgque._key_sessions(key): every lock on the bigint advisory key in this
-- database, held or awaited: the session's pid (null for a prepared
-- transaction), its login role, the mode and whether it is granted. The
-- activity snapshot is taken anew (PostgreSQL keeps one per transaction), so
-- a session that started since the transaction began is known too.
create or replace function pgque._key_sessions(p_key bigint)
returns table (pid integer, role oid, mode text, granted boolean)
language sql volatile
set search_path = pg_catalog, pg_temp
as $$
    select pg_stat_clear_snapshot();
    select l.pid, a.usesysid, l.mode, l.granted
      from pg_locks l
      left join pg_stat_activity a on a.pid = l.pid
     where l.locktype = 'advisory' and l.objsubid = 1
       and l.database = (select oid from pg_database where datname = current_database())
       and l.classid = ((p_key >> 32) & 4294967295)::oid
       and l.objid = (p_key & 4294967295)::oid
$$;

-- pgque._unlock_key(key): releases every exclusive hold of this session on
-- the bigint key; true when there was one. (Unlocking a lock not held makes
-- the server warn, hence the client_min_messages.)
create or replace function pgque._unlock_key(p_key bigint)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = error
as $$
declare
    v_released boolean := false;
begin
    while pg_advisory_unlock(p_key) loop
        v_released := true;
    end loop;
    return v_released;
end
$$;

-- pgque._session_role(): the login role of this session as other sessions see
-- it in pg_stat_activity, which is what they judge its locks by.
create or replace function pgque._session_role()
returns oid
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select usesysid from pg_stat_activity where pid = pg_backend_pid());
end
$$;

-- pgque._current_key(kind, id): the current key of a slot ('slot', its sub_id)
-- or of the ticker election ('ticker', id ignored).
create or replace function pgque._current_key(p_kind text, p_id integer)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return case p_kind
        when 'slot' then (select s.sub_lock_key from pgque.subscription s where s.sub_id = p_id)
        else (select e.te_key from pgque.ticker_election e)
    end;
end
$$;

-- pgque._counts_on_key(kind, role, queue, group): whether sessions of login
-- role (an oid) count on such a key: for a slot, if the role may use the
-- group; for the election, if it may tick.
create or replace function pgque._counts_on_key(
    p_kind text, p_role oid, p_queue pgque.queue, p_group pgque.consumer_group)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_kind = 'ticker' then
        return pgque._may_tick(p_role);
    end if;
    return pgque._may_consume(p_role, p_queue, p_group.cg_owner, p_group.cg_grantees);
end
$$;

-- pgque._take_key(kind, id, queue, group): tries, without waiting, to take
-- the exclusive session lock on the current key of a slot or the election
-- (see _current_key); true when this session now holds it, twice (see the
-- top of this file). When the key is held or awaited only by sessions that
-- do not count (_counts_on_key), and by no counting session, it draws a new
-- key and tries that: pg_locks shows keys to everyone, and advisory locks
-- need no privilege. A lock taken on a key that a concurrent caller renewed
-- meanwhile is let go: it owns nothing.
create or replace function pgque._take_key(
    p_kind text, p_id integer,
    p_queue pgque.queue default null, p_group pgque.consumer_group default null)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key bigint := pgque._current_key(p_kind, p_id);
    v_now bigint;
begin
    for attempt in 1 .. 3 loop
        if pg_try_advisory_lock(v_key) then
            v_now := pgque._current_key(p_kind, p_id);
            if v_now = v_key then
                -- The second hold: re-entrant, so it is granted at once.
                return pg_try_advisory_lock(v_key);
            end if;
            perform pgque._unlock_key(v_key);
            v_key := v_now;
            continue;
        end if;
        exit when not exists (
                     select 1 from pgque._key_sessions(v_key) k
                      where not pgque._counts_on_key(p_kind, k.role, p_queue, p_group))
               or exists (
                     select 1 from pgque._key_sessions(v_key) k
                      where k.granted and k.mode = 'ExclusiveLock'
                        and pgque._counts_on_key(p_kind, k.role, p_queue, p_group));
        -- Only where the key is still the one seen: one renewal per round.
        if p_kind = 'slot' then
            update pgque.subscription set sub_lock_key = pgque._random_key()
             where sub_id = p_id and sub_lock_key = v_key;
        else
            update pgque.ticker_election set te_key = pgque._random_key()
             where te_key = v_key;
        end if;
        v_key := pgque._current_key(p_kind, p_id);
    end loop;
    return false;
end
$$;

-- ===== code/slots/ownership.sql =====
-- pgque: slot ownership: claiming and releasing a slot, and the owner check.

-- pgque.slot_lock_key(queue, consumer, slot): the bigint key of the session
-- advisory lock that owns the slot now (random per slot; claim_slot may
-- renew it, so do not keep it). Refused (PQ014) to roles that may not use
-- the group.
create or replace function pgque.slot_lock_key(p_queue text, p_consumer text, p_slot integer)
returns bigint
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, null, false);
    return (v.sub).sub_lock_key;
end
$$;

-- pgque._require_counting_session(queue, group): PQ014 unless the locks of
-- this session will count for the group, i.e. unless its login role (not only
-- the role it SETs) may use the group: otherwise it could hold a slot's lock
-- that nobody counts, and lose the slot to the next claim.
create or replace function pgque._require_counting_session(
    p_queue pgque.queue, p_group pgque.consumer_group)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_login oid := pgque._session_role();
begin
    if not pgque._may_consume(v_login, p_queue, p_group.cg_owner, p_group.cg_grantees) then
        raise exception using errcode = 'PQ014',
            message = format('sessions of login role %s do not count in group %L of queue %L',
                             v_login::regrole, p_group.cg_consumer, p_queue.queue_name),
            hint = 'Slot owners and members are judged by their login role: grant the login '
                   'role (or a role it is a member of) the group and pgque_reader.';
    end if;
end
$$;

-- pgque._holds_slot(sub): whether this session holds the slot's lock exclusively.
create or replace function pgque._holds_slot(p_sub pgque.subscription)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    return pgque._holds_key(p_sub.sub_lock_key);
end
$$;

-- pgque._require_owner(sub): PQ024 unless this session holds the slot's lock.
create or replace function pgque._require_owner(p_sub pgque.subscription)
returns void
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._holds_slot(p_sub) then
        raise exception using errcode = 'PQ024',
            message = format('this session does not own slot %L', p_sub.sub_consumer),
            hint = 'Claim the slot first (pgque.claim_slot); a session that lost its lock '
                   'must not receive or ack for the slot.';
    end if;
end
$$;

-- pgque.claim_slot(queue, consumer, slot): tries, without waiting, to take
-- the slot's session advisory lock; true when this session now holds it
-- (also when it already did; the lock is never taken twice). When the key is
-- held or awaited only by sessions whose roles may not use the group, the
-- key is renewed first (see the top of this file), so such a session cannot
-- keep a slot from its workers. Refused (PQ014) to roles that may not use
-- the group.
create or replace function pgque.claim_slot(p_queue text, p_consumer text, p_slot integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, null, false);
    perform pgque._require_counting_session(v.queue, v.grp);
    return pgque._holds_slot(v.sub)
        or pgque._take_key('slot', (v.sub).sub_id, v.queue, v.grp);
end
$$;

-- pgque.release_slot(queue, consumer, slot): releases the slot's lock if
-- this session holds it, ending its epoch first (see slots/fence.sql); true when
-- it did.
create or replace function pgque.release_slot(p_queue text, p_consumer text, p_slot integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, null, false);
    if pgque._holds_slot(v.sub) then
        perform pgque._end_epoch(v.sub);
    end if;
    return pgque._unlock_key((v.sub).sub_lock_key);
end
$$;

-- ===== code/slots/pause.sql =====
-- pgque: the pause failure policy: blocked keys and their held events.
--
-- Under 'skip' (the default) a failed event goes to the retry queue and its
-- key moves on. Under 'pause' a failed event of key K blocks K in its slot:
-- no later event of K is handed out until the failed one (the head) is
-- handled or dead-lettered; then K's held events follow in order.
--
-- The happy path writes nothing new. A blocked key is one marker row
-- (pgque.blocked_key), written at its failures and releases. While a slot has
-- markers, its receive sets the events of their keys aside, in the order it
-- reads them, into pgque.held_event (never updated or deleted; rotated and
-- emptied by TRUNCATE like the retry queue), instead of handing them out.
-- Setting an event aside does not count as a retry: its retry count stays as
-- it was, and the marker's attempts count only the head's real failures.
--
-- A key whose head is due (bk_retry_at passed) is handed out from the held
-- events: a piece with a batch id of its own, at most max_events events of
-- the due keys, before the slot's next piece of the log. Its ack moves each
-- key on past what was handled; a failure makes the failed event the head
-- again (its attempts counted) and keeps the rest held. A marker goes once
-- its key has nothing held, in the ack that handled the last event: from
-- then on the slot's reads hand the key's events out again, and every event
-- of the key they met before was set aside, so the order holds.
--
-- A slot has at most one piece handed out and not acked: its piece of the
-- log, or its piece of held events. A receive hands out the same piece again
-- until it is acked, as receive does for the log. After max_attempts
-- failures, or once the head blocked the key for pause_timeout, the head goes
-- to the dead letters and the key moves on (both per group; null: no bound).

-- pgque._has_blocked(sub_id): whether the slot subscription has a blocked key.
create or replace function pgque._has_blocked(p_sub_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.blocked_key b where b.bk_sub = p_sub_id)
$$;

-- pgque._held_due(sub_id): whether the slot subscription has a piece of held
-- events to hand out: one handed out and not acked, or a key whose head is due.
create or replace function pgque._held_due(p_sub_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    -- A key's piece is handed out only once its head is due, and nothing
    -- delays a key while its piece is out: one probe of blocked_key_ready.
    select exists (select from pgque.blocked_key b
                    where b.bk_sub = p_sub_id and b.bk_retry_at <= now())
$$;

-- pgque._log_piece_open(cur): whether the cursor's last piece of the log was
-- handed out and not acked (the receive hands it out again).
create or replace function pgque._log_piece_open(p_cur pgque.cursor)
returns boolean
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select p_cur.cur_batch is not null
           and coalesce(p_cur.cur_handed, 0) > coalesce(p_cur.cur_pos, 0)
$$;

-- pgque._is_held(sub_id, batch_id, key, ev_id): whether an event of the
-- slot's log (in batch batch_id) is held: its key is blocked from an earlier
-- point of the log.
create or replace function pgque._is_held(p_sub_id integer, p_batch_id bigint, p_key text,
                                          p_ev_id bigint)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.blocked_key b
                    where b.bk_sub = p_sub_id and b.bk_key = p_key
                      and (b.bk_from_batch < p_batch_id
                           or (b.bk_from_batch = p_batch_id and p_ev_id >= b.bk_from_ev)))
$$;

-- pgque._hold_events(sub_id, batch_id, events): the events of a slot's piece
-- of the log (of batch batch_id, ev_id order) without those that are held,
-- which it sets aside into pgque.held_event, in order, unless they were set
-- aside from this batch already (a piece handed out again, maybe cut
-- otherwise). The caller holds the receive lock.
create or replace function pgque._hold_events(
    p_sub_id integer, p_batch_id bigint, p_events pgque.event_template[])
returns pgque.event_template[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[];
    v_part smallint;
begin
    -- The piece's keys that are blocked, in one index scan: most pieces have
    -- none, and go out as they are.
    v_keys := array(select b.bk_key from pgque.blocked_key b
                     where b.bk_sub = p_sub_id
                       and b.bk_key = any (array(select distinct e.ev_extra1
                                                   from unnest(p_events) e)));
    if cardinality(v_keys) = 0 then
        return p_events;
    end if;
    v_part := pgque._write_part('held');
    insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                  ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
    select p_sub_id, h.ev_extra1, nextval('pgque.held_seq'), p_batch_id, h.ev_id, h.ev_time,
           h.ev_txid, h.ev_retry, h.ev_type, h.ev_data, h.ev_delayed_id, v_part
      from (select e.* from unnest(p_events) e
             where e.ev_extra1 = any (v_keys)
               and pgque._is_held(p_sub_id, p_batch_id, e.ev_extra1, e.ev_id)
               and not exists (select from pgque.held_event x
                                where x.he_sub = p_sub_id and x.he_batch = p_batch_id
                                  and x.ev_id = e.ev_id)
             order by e.ev_id) h;
    return array(select e from unnest(p_events) e
                  where not (e.ev_extra1 = any (v_keys)
                             and pgque._is_held(p_sub_id, p_batch_id, e.ev_extra1, e.ev_id))
                  order by e.ev_id);
end
$$;

-- pgque._receive_held(queue, group, sub, max_events, epoch, slot): the slot's
-- piece of held events, as batch_event rows: the piece handed out and not
-- acked again (to the same owner), else a new one (a new batch id) of the
-- keys whose head is due, oldest due first, each key's events in order, at
-- most max_events in all (null: every one). No rows when there is none. The
-- head of a key comes with its attempts as its retry count. A piece whose
-- owner lost the slot before its ack (another epoch now) is made anew, its
-- loss noted as the heads' last error but not counted as an attempt (a crash
-- or a restart is not the handler's failure); a head due past pause_timeout
-- goes to the dead letters without another try, which also bounds a head
-- that kills its worker every time. The caller
-- holds the receive lock and checked that the slot's piece of the log is not
-- open.
create or replace function pgque._receive_held(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription,
    p_max_events integer, p_epoch bigint, p_slot integer)
returns setof pgque.batch_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_batch bigint;
    v_then bigint;
    v_marker pgque.blocked_key;
begin
    select b.bk_batch, b.bk_epoch into v_batch, v_then from pgque.blocked_key b
     where b.bk_sub = p_sub.sub_id and b.bk_retry_at <= now() and b.bk_batch is not null
     limit 1;
    if v_batch is not null and v_then is distinct from p_epoch then
        -- Lost with its owner: not the handler's failure (a crash, a restart),
        -- so no attempt is counted; the piece is made anew, and its heads that
        -- blocked their keys for pause_timeout go to the dead letters below.
        update pgque.blocked_key b
           set bk_batch = null, bk_handed_seq = null, bk_epoch = null,
               bk_last_error = 'lost: the session that had it ended before its ack',
               bk_last_failure = now()
         where b.bk_sub = p_sub.sub_id and b.bk_batch = v_batch;
        v_batch := null;
    end if;
    if v_batch is null then
        for v_marker in select * from pgque.blocked_key b
                         where b.bk_sub = p_sub.sub_id and b.bk_retry_at <= now()
                           and (b.bk_attempts > 0 or b.bk_last_error like 'lost: %')
                           and now() >= b.bk_since + p_group.cg_pause_timeout
                         order by b.bk_key for update loop
            perform pgque._kill_head(p_queue, p_sub, v_marker,
                                     coalesce(v_marker.bk_last_error || '; ', '')
                                     || 'pause_timeout passed');
        end loop;
        v_batch := nextval('pgque.batch_id_seq');
        with due as (
            select b.bk_key, b.bk_done_seq, b.bk_retry_at from pgque.blocked_key b
             where b.bk_sub = p_sub.sub_id and b.bk_retry_at <= now()
             order by b.bk_retry_at, b.bk_key
             limit p_max_events
        ), events as (
            select d.bk_key, h.he_seq,
                   row_number() over (order by d.bk_retry_at, d.bk_key, h.he_seq) as n
              from due d
              join pgque.held_event h
                on h.he_sub = p_sub.sub_id and h.he_key = d.bk_key and h.he_seq > d.bk_done_seq
        ), picked as (
            select e.bk_key, max(e.he_seq) as last from events e
             where p_max_events is null or e.n <= p_max_events
             group by e.bk_key
        )
        update pgque.blocked_key b set bk_batch = v_batch, bk_handed_seq = p.last,
                                       bk_epoch = p_epoch
          from picked p
         where b.bk_sub = p_sub.sub_id and b.bk_key = p.bk_key;
        if not found then
            return;
        end if;
    end if;
    return query
        select v_batch, h.ev_id, h.ev_time,
               h.ev_retry + case when h.he_seq = f.first then b.bk_attempts else 0 end,
               h.ev_type, h.ev_data, h.he_key, p_epoch, p_slot, h.ev_delayed_id
          from pgque.blocked_key b
          join pgque.held_event h
            on h.he_sub = b.bk_sub and h.he_key = b.bk_key
           and h.he_seq > b.bk_done_seq and h.he_seq <= b.bk_handed_seq
         cross join lateral (select min(x.he_seq) as first from pgque.held_event x
                              where x.he_sub = b.bk_sub and x.he_key = b.bk_key
                                and x.he_seq > b.bk_done_seq) f
         where b.bk_sub = p_sub.sub_id and b.bk_batch = v_batch
         order by b.bk_retry_at, b.bk_key, h.he_seq;
end
$$;

-- pgque._check_nack_args(batch_id, ev_ids, reasons, retry_after,
-- retry_afters, dead_ids): the checks every nack makes of its arguments: 22023
-- for a negative or null retry_after, a count of reasons that is neither one
-- nor one per id, retry_afters not one per id or with a negative one, or a
-- dead id that is not among ev_ids; PQ010 for a null id.
create or replace function pgque._check_nack_args(p_batch_id bigint, p_ev_ids bigint[],
                                                  p_reasons text[], p_retry_after interval,
                                                  p_retry_afters interval[] default null,
                                                  p_dead_ids bigint[] default null)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_retry_after is null or p_retry_after < interval '0' then
        raise exception using errcode = '22023', message = 'retry_after must not be negative';
    end if;
    if coalesce(cardinality(p_ev_ids), 0) = 0 then
        return;
    end if;
    if array_position(p_ev_ids, null) is not null then
        raise exception using errcode = 'PQ010',
            message = format('nack: event id must not be null (batch %s)', p_batch_id);
    end if;
    if cardinality(p_reasons) not in (1, cardinality(p_ev_ids)) then
        raise exception using errcode = '22023',
            message = 'nack: give one reason, or one per event id';
    end if;
    if p_retry_afters is not null
       and (cardinality(p_retry_afters) <> cardinality(p_ev_ids)
            or exists (select from unnest(p_retry_afters) d where d < interval '0')) then
        raise exception using errcode = '22023',
            message = 'nack: retry_afters must be one per event id, none negative';
    end if;
    if exists (select from unnest(p_dead_ids) d where d is null or d <> all(p_ev_ids)) then
        raise exception using errcode = '22023',
            message = 'nack: every dead id must be one of the nacked event ids';
    end if;
end
$$;

-- pgque._delay_of(ev_ids, retry_afters, retry_after, ev_id): how long the
-- failed event ev_id waits before it is due again: its own of retry_afters,
-- else retry_after.
create or replace function pgque._delay_of(p_ev_ids bigint[], p_retry_afters interval[],
                                           p_retry_after interval, p_ev_id bigint)
returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select coalesce(p_retry_afters[array_position(p_ev_ids, p_ev_id)], p_retry_after) $$;

-- pgque._reason_of(ev_ids, reasons, ev_id): the reason given for ev_id.
create or replace function pgque._reason_of(p_ev_ids bigint[], p_reasons text[], p_ev_id bigint)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when cardinality(p_reasons) = 1 then p_reasons[1]
                else p_reasons[array_position(p_ev_ids, p_ev_id)] end
$$;

-- pgque._fail_head(queue, group, sub, key, head_seq, reason, retry_after):
-- records a failure of the event of blocked key key at head_seq (the marker
-- exists): it becomes the head (its attempts counted on, or from 1 when it was
-- not the head yet), due again after retry_after; once it failed
-- max_attempts times, or blocked the key for pause_timeout, it goes to the
-- dead letters instead and the key moves on; so it does at once when
-- dead_now (a failure retrying cannot heal). Returns 1 when it was
-- dead-lettered, else 0. Deletes the marker when nothing is left held.
create or replace function pgque._fail_head(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription, p_key text,
    p_head_seq bigint, p_reason text, p_retry_after interval, p_dead_now boolean default false)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_marker pgque.blocked_key;
begin
    select * into v_marker from pgque.blocked_key b
     where b.bk_sub = p_sub.sub_id and b.bk_key = p_key;
    if (select min(h.he_seq) from pgque.held_event h
         where h.he_sub = p_sub.sub_id and h.he_key = p_key
           and h.he_seq > v_marker.bk_done_seq) = p_head_seq and v_marker.bk_attempts > 0 then
        v_marker.bk_attempts := v_marker.bk_attempts + 1;  -- the head failed again
    else
        v_marker.bk_attempts := 1;
        v_marker.bk_since := now();
        v_marker.bk_first_error := p_reason;
    end if;
    v_marker.bk_done_seq := p_head_seq - 1;
    v_marker.bk_last_error := p_reason;
    v_marker.bk_last_failure := now();
    v_marker.bk_retry_at := least(now() + p_retry_after,
                                  v_marker.bk_since + p_group.cg_pause_timeout);
    if p_dead_now or v_marker.bk_attempts >= p_group.cg_max_attempts
       or now() >= v_marker.bk_since + p_group.cg_pause_timeout then
        perform pgque._kill_head(p_queue, p_sub, v_marker, p_reason);
        return 1;
    end if;
    perform pgque._save_marker(v_marker);
    return 0;
end
$$;

-- pgque._held_to_retry(queue, sub, held, reason, retry_after): a held event
-- that failed while its group has the 'skip' policy goes where a failure goes
-- under 'skip': to the retry queue, or to the dead letters once it was retried
-- max_retries times (or at once when dead_now). Returns 1 for a dead letter,
-- else 0.
create or replace function pgque._held_to_retry(
    p_queue pgque.queue, p_sub pgque.subscription, p_held pgque.held_event, p_reason text,
    p_retry_after interval, p_dead_now boolean default false)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_held.ev_retry < p_queue.queue_max_retries and not p_dead_now then
        insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time,
                                       ev_retry, ev_type, ev_data, ev_extra1, ev_delayed_id,
                                       rq_part)
        values (now() + p_retry_after, p_queue.queue_id, p_sub.sub_id, p_held.ev_id,
                p_held.ev_time, p_held.ev_retry + 1, p_held.ev_type, p_held.ev_data,
                p_held.he_key, p_held.ev_delayed_id, pgque._write_part('retry'));
        return 0;
    end if;
    insert into pgque.dead_letter (dl_queue, dl_consumer, dl_sub, dl_reason, ev_id, ev_time,
                                   ev_txid, ev_retry, ev_type, ev_data, ev_extra1)
    values (p_queue.queue_id, p_sub.sub_consumer, p_sub.sub_id, p_reason, p_held.ev_id,
            p_held.ev_time, p_held.ev_txid, p_held.ev_retry, p_held.ev_type, p_held.ev_data,
            p_held.he_key);
    return 1;
end
$$;

-- pgque._kill_head(queue, sub, marker, reason): the marker's head goes to the
-- dead letters with reason, its retry count the retries it had (its failures
-- less one), and its key moves on: what is held behind it is due now.
create or replace function pgque._kill_head(p_queue pgque.queue, p_sub pgque.subscription,
                                            p_marker pgque.blocked_key, p_reason text)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_head pgque.held_event := pgque._head_of(p_marker);
begin
    insert into pgque.dead_letter (dl_queue, dl_consumer, dl_sub, dl_reason, ev_id, ev_time,
                                   ev_txid, ev_retry, ev_type, ev_data, ev_extra1)
    values (p_queue.queue_id, p_sub.sub_consumer, p_sub.sub_id, p_reason, v_head.ev_id,
            v_head.ev_time, v_head.ev_txid,
            v_head.ev_retry + greatest(p_marker.bk_attempts - 1, 0), v_head.ev_type,
            v_head.ev_data, p_marker.bk_key);
    p_marker.bk_done_seq := v_head.he_seq;
    p_marker.bk_attempts := 0;
    p_marker.bk_retry_at := now();
    perform pgque._save_marker(p_marker);
    return v_head.ev_id;
end
$$;

-- pgque._save_marker(marker): writes a marker back with its piece closed,
-- or deletes it when its key has nothing left held.
create or replace function pgque._save_marker(p_marker pgque.blocked_key)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if not exists (select from pgque.held_event h
                    where h.he_sub = p_marker.bk_sub and h.he_key = p_marker.bk_key
                      and h.he_seq > p_marker.bk_done_seq) then
        delete from pgque.blocked_key b
         where b.bk_sub = p_marker.bk_sub and b.bk_key = p_marker.bk_key;
        return;
    end if;
    update pgque.blocked_key b
       set bk_done_seq = p_marker.bk_done_seq, bk_attempts = p_marker.bk_attempts,
           bk_retry_at = p_marker.bk_retry_at, bk_since = p_marker.bk_since,
           bk_first_error = p_marker.bk_first_error, bk_last_error = p_marker.bk_last_error,
           bk_last_failure = p_marker.bk_last_failure, bk_batch = null, bk_handed_seq = null,
           bk_epoch = null
     where b.bk_sub = p_marker.bk_sub and b.bk_key = p_marker.bk_key;
end
$$;

-- pgque._ack_held(queue, group, sub, batch_id, nack_ids, reasons,
-- retry_after): acks the slot's piece of held events batch_id, with the
-- given events of it failed: each key moves on past what it handled, up to
-- its first failed event, which becomes its head (_fail_head); a key with
-- nothing left held is unblocked. Returns true (a piece of held events is
-- always finished by its ack). PQ003 unless batch_id is the piece handed out,
-- PQ010 for a failed id not in it; 22023 for bad arguments (_check_nack_args).
create or replace function pgque._ack_held(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription,
    p_batch_id bigint, p_nack_ids bigint[], p_reasons text[], p_retry_after interval,
    p_retry_afters interval[] default null, p_dead_ids bigint[] default null)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_marker pgque.blocked_key;
    v_failed bigint;
    v_failed_id bigint;
begin
    perform pgque._check_nack_args(p_batch_id, p_nack_ids, p_reasons, p_retry_after,
                                   p_retry_afters, p_dead_ids);
    if exists (select from unnest(p_nack_ids) i
                where not exists (
                    select from pgque.blocked_key b
                      join pgque.held_event h
                        on h.he_sub = b.bk_sub and h.he_key = b.bk_key
                       and h.he_seq > b.bk_done_seq and h.he_seq <= b.bk_handed_seq
                     where b.bk_sub = p_sub.sub_id and b.bk_batch = p_batch_id
                       and h.ev_id = i)) then
        raise exception using errcode = 'PQ010',
            message = format('nack: some of events %s are not among those handed out of batch %s',
                             pgque._name_for_message(p_nack_ids::text), p_batch_id);
    end if;
    for v_marker in select * from pgque.blocked_key b
                     where b.bk_sub = p_sub.sub_id and b.bk_batch = p_batch_id
                     order by b.bk_key
                     for update loop
        if p_group.cg_policy = 'skip' then
            -- Released by a change to 'skip': what failed is retried, the rest is done.
            perform pgque._held_to_retry(p_queue, p_sub, h,
                                         pgque._reason_of(p_nack_ids, p_reasons, h.ev_id),
                                         pgque._delay_of(p_nack_ids, p_retry_afters,
                                                         p_retry_after, h.ev_id),
                                         h.ev_id = any(coalesce(p_dead_ids, '{}')))
               from pgque.held_event h
              where h.he_sub = p_sub.sub_id and h.he_key = v_marker.bk_key
                and h.he_seq > v_marker.bk_done_seq and h.he_seq <= v_marker.bk_handed_seq
                and h.ev_id = any(p_nack_ids);
            v_marker.bk_done_seq := v_marker.bk_handed_seq;
            v_marker.bk_attempts := 0;
            perform pgque._save_marker(v_marker);
            continue;
        end if;
        select min(h.he_seq) into v_failed from pgque.held_event h
         where h.he_sub = p_sub.sub_id and h.he_key = v_marker.bk_key
           and h.he_seq > v_marker.bk_done_seq and h.he_seq <= v_marker.bk_handed_seq
           and h.ev_id = any(p_nack_ids);
        if v_failed is null then
            v_marker.bk_done_seq := v_marker.bk_handed_seq;
            v_marker.bk_attempts := 0;
            perform pgque._save_marker(v_marker);
        else
            select h.ev_id into v_failed_id from pgque.held_event h
             where h.he_sub = p_sub.sub_id and h.he_key = v_marker.bk_key
               and h.he_seq = v_failed limit 1;
            perform pgque._fail_head(
                p_queue, p_group, p_sub, v_marker.bk_key, v_failed,
                pgque._reason_of(p_nack_ids, p_reasons, v_failed_id),
                pgque._delay_of(p_nack_ids, p_retry_afters, p_retry_after, v_failed_id),
                v_failed_id = any(coalesce(p_dead_ids, '{}')));
        end if;
    end loop;
    if not found then
        raise exception using errcode = 'PQ003',
            message = format('batch %s is not the open batch of consumer %L', p_batch_id,
                             p_sub.sub_consumer);
    end if;
    return true;
end
$$;

-- pgque._block_keys(queue, group, sub, cur, batch_id, ev_ids, reasons,
-- retry_after, slot): the nack of a slot of a 'pause' group: each key of the
-- failed events (handed out of the open piece of the log) is blocked from its
-- first failed event on, which becomes the head (_fail_head), and the key's
-- failed events are set aside in order: the caller nacks, with the one that
-- failed, each later event of its key in the piece that it did not handle
-- (those it did handle are done); events without a partition key are nacked
-- as under 'skip'. A key blocked already at that
-- event by this batch (a repeated nack) is left as it is. Returns how many
-- went to the dead letters.
create or replace function pgque._block_keys(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription,
    p_cur pgque.cursor, p_batch_id bigint, p_ev_ids bigint[], p_reasons text[],
    p_retry_after interval, p_slot integer, p_retry_afters interval[] default null,
    p_dead_ids bigint[] default null)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_events pgque.event_template[];
    v_first record;
    v_keyless bigint[];
    v_dead integer := 0;
    v_part smallint;
    v_head_seq bigint;
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    perform pgque._check_nack_args(p_batch_id, p_ev_ids, p_reasons, p_retry_after,
                                   p_retry_afters, p_dead_ids);
    if coalesce(cardinality(p_ev_ids), 0) = 0 then
        return 0;
    end if;
    -- The piece as handed out: read again, without what a repeated nack set aside.
    v_events := pgque._batch_events(
        p_queue.queue_id, p_sub.sub_id,
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
        coalesce(p_cur.cur_pos, 0), p_cur.cur_handed, null, null, p_slot, p_group.cg_slots);
    if exists (select from unnest(p_ev_ids) i
                where not exists (select from unnest(v_events) e where e.ev_id = i)) then
        raise exception using errcode = 'PQ010',
            message = format('nack: some of events %s are not among those handed out of batch %s',
                             pgque._name_for_message(p_ev_ids::text), p_batch_id);
    end if;
    v_keyless := array(select e.ev_id from unnest(v_events) e
                        where e.ev_id = any(p_ev_ids) and e.ev_extra1 is null);
    if cardinality(v_keyless) > 0 then
        v_dead := pgque._nack(p_queue, p_sub, p_cur, p_batch_id, v_keyless,
                              array(select pgque._reason_of(p_ev_ids, p_reasons, i)
                                      from unnest(v_keyless) i),
                              p_retry_after, p_slot, p_group.cg_slots,
                              array(select pgque._delay_of(p_ev_ids, p_retry_afters,
                                                           p_retry_after, i)
                                      from unnest(v_keyless) i),
                              array(select i from unnest(v_keyless) i
                                     where i = any(coalesce(p_dead_ids, '{}'))));
    end if;
    v_part := pgque._write_part('held');
    for v_first in select e.ev_extra1 as key, min(e.ev_id) as ev_id
                     from unnest(v_events) e
                    where e.ev_id = any(p_ev_ids) and e.ev_extra1 is not null
                    group by e.ev_extra1
                    order by 1 loop
        if exists (select from pgque.blocked_key b
                    where b.bk_sub = p_sub.sub_id and b.bk_key = v_first.key) then
            -- Blocked already: by a nack of this piece before (a repeated or a
            -- second nack), or by a dead letter replayed as the key's next event
            -- while the piece was out. What is not set aside yet joins the queue.
            v_dead := v_dead + pgque._merge_held(
                p_queue, p_group, p_sub, v_first.key, p_batch_id,
                array(select e from unnest(v_events) e
                       where e.ev_extra1 = v_first.key and e.ev_id = any(p_ev_ids)
                       order by e.ev_id),
                p_ev_ids, p_reasons, p_retry_after, p_retry_afters, p_dead_ids);
            continue;
        end if;
        insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                      ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
        select p_sub.sub_id, h.ev_extra1, nextval('pgque.held_seq'), p_batch_id, h.ev_id,
               h.ev_time, h.ev_txid, h.ev_retry, h.ev_type, h.ev_data, h.ev_delayed_id, v_part
          from (select e.* from unnest(v_events) e
                 where e.ev_extra1 = v_first.key and e.ev_id = any(p_ev_ids)
                 order by e.ev_id) h;
        select min(h.he_seq) into v_head_seq from pgque.held_event h
         where h.he_sub = p_sub.sub_id and h.he_key = v_first.key and h.ev_id = v_first.ev_id
           and h.he_part = v_part;
        insert into pgque.blocked_key (bk_sub, bk_key, bk_from_batch, bk_from_ev, bk_done_seq,
                                       bk_attempts, bk_retry_at, bk_since)
        values (p_sub.sub_id, v_first.key, p_batch_id, v_first.ev_id, v_head_seq - 1,
                0, now(), now());
        v_dead := v_dead + pgque._fail_head(
            p_queue, p_group, p_sub, v_first.key, v_head_seq,
            pgque._reason_of(p_ev_ids, p_reasons, v_first.ev_id),
            pgque._delay_of(p_ev_ids, p_retry_afters, p_retry_after, v_first.ev_id),
            v_first.ev_id = any(coalesce(p_dead_ids, '{}')));
    end loop;
    return v_dead;
end
$$;

-- pgque._merge_held(queue, group, sub, key, batch_id, events, ev_ids, reasons,
-- retry_after, retry_afters, dead_ids): the failed events of blocked key key
-- that a piece of the log (batch batch_id) handed out, not set aside yet, join
-- its queue of held events where they belong: after what the slot read before
-- them, before what it read after (the queue is copied anew, in that order:
-- rows are never updated). When one of them comes before the head, it is the
-- head now, and its failure counts (_fail_head). Returns how many went to the
-- dead letters.
create or replace function pgque._merge_held(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription, p_key text,
    p_batch_id bigint, p_events pgque.event_template[], p_ev_ids bigint[], p_reasons text[],
    p_retry_after interval, p_retry_afters interval[], p_dead_ids bigint[])
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_marker pgque.blocked_key;
    v_head pgque.held_event;
    v_new pgque.event_template[];
    v_start bigint;
    v_first pgque.held_event;
begin
    select * into v_marker from pgque.blocked_key b
     where b.bk_sub = p_sub.sub_id and b.bk_key = p_key
       for update;
    v_new := array(select e from unnest(p_events) e
                    where not exists (select from pgque.held_event x
                                       where x.he_sub = p_sub.sub_id
                                         and x.he_batch = p_batch_id and x.ev_id = e.ev_id)
                    order by e.ev_id);
    if cardinality(v_new) = 0 then
        return 0;  -- set aside already: a nack repeated
    end if;
    v_head := pgque._head_of(v_marker);
    v_start := nextval('pgque.held_seq');
    -- Pending rows keep their order; a new one goes before the first pending row
    -- the slot read after it (of a later batch, or later in this batch).
    with pending as (
        select h.*, row_number() over (order by h.he_seq) as pos
          from pgque.held_event h
         where h.he_sub = p_sub.sub_id and h.he_key = p_key
           and h.he_seq > v_marker.bk_done_seq
    ), merged as (
        select p.he_batch, p.ev_id, p.ev_time, p.ev_txid, p.ev_retry, p.ev_type, p.ev_data,
               p.ev_delayed_id, p.pos as anchor, 1 as kind
          from pending p
        union all
        select p_batch_id, e.ev_id, e.ev_time, e.ev_txid, e.ev_retry, e.ev_type, e.ev_data,
               e.ev_delayed_id,
               coalesce((select min(p.pos) from pending p
                          where p.he_batch > p_batch_id
                             or (p.he_batch = p_batch_id and p.ev_id > e.ev_id)),
                        (select count(*) + 1 from pending)), 0
          from unnest(v_new) e
    )
    insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                  ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
    select p_sub.sub_id, p_key, nextval('pgque.held_seq'), m.he_batch, m.ev_id, m.ev_time,
           m.ev_txid, m.ev_retry, m.ev_type, m.ev_data, m.ev_delayed_id, pgque._write_part('held')
      from (select * from merged order by anchor, kind, ev_id) m;
    update pgque.blocked_key b set bk_done_seq = v_start
     where b.bk_sub = p_sub.sub_id and b.bk_key = p_key;
    v_marker.bk_done_seq := v_start;
    v_first := pgque._head_of(v_marker);
    if v_first.ev_id is distinct from v_head.ev_id then
        -- A failed event the slot read before the head: the head now.
        update pgque.blocked_key b set bk_attempts = 0
         where b.bk_sub = p_sub.sub_id and b.bk_key = p_key;
        return pgque._fail_head(
            p_queue, p_group, p_sub, p_key, v_first.he_seq,
            pgque._reason_of(p_ev_ids, p_reasons, v_first.ev_id),
            pgque._delay_of(p_ev_ids, p_retry_afters, p_retry_after, v_first.ev_id),
            v_first.ev_id = any(coalesce(p_dead_ids, '{}')));
    end if;
    return 0;
end
$$;

-- pgque._slot_nack_ack(queue, group, sub, cur, batch_id, nack_ids, reasons,
-- retry_after, slot): the ack of a slot's piece, with its failed events: of
-- the piece of held events when batch_id is that (_ack_held), else of the
-- piece of the log, whose failures the group's policy decides (_block_keys
-- or _nack) before its ack. Returns what the ack returns.
create or replace function pgque._slot_nack_ack(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription,
    p_cur pgque.cursor, p_batch_id bigint, p_nack_ids bigint[], p_reasons text[],
    p_retry_after interval, p_slot integer, p_retry_afters interval[] default null,
    p_dead_ids bigint[] default null)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    -- Retries under skip count against the group's max_retries when it has one.
    p_queue.queue_max_retries := coalesce(p_group.cg_max_retries, p_queue.queue_max_retries);
    if p_batch_id is distinct from p_cur.cur_batch
       and exists (select from pgque.blocked_key b
                    where b.bk_sub = p_sub.sub_id and b.bk_batch = p_batch_id) then
        return pgque._ack_held(p_queue, p_group, p_sub, p_batch_id, p_nack_ids, p_reasons,
                               p_retry_after, p_retry_afters, p_dead_ids);
    end if;
    if p_group.cg_policy = 'pause' then
        perform pgque._block_keys(p_queue, p_group, p_sub, p_cur, p_batch_id, p_nack_ids,
                                  p_reasons, p_retry_after, p_slot, p_retry_afters, p_dead_ids);
    else
        perform pgque._nack(p_queue, p_sub, p_cur, p_batch_id, p_nack_ids, p_reasons,
                            p_retry_after, p_slot, p_group.cg_slots, p_retry_afters,
                            p_dead_ids);
    end if;
    return pgque._ack(p_sub, p_cur, p_batch_id);
end
$$;

-- pgque._set_policy(queue, group, policy, max_attempts, pause_timeout,
-- max_retries): sets a group's failure policy, the bounds of a pause (null:
-- none) and the retries of a failed event under skip (null: the queue's
-- max_retries). 22023 for a policy other than 'skip' or 'pause',
-- max_attempts below 1, a pause_timeout not above zero or a negative
-- max_retries; nothing changes then. Going to 'skip'
-- releases every blocked key of the group: their held events are handed out
-- next, in order, and a failure among them goes to the retry queue.
create or replace function pgque._set_policy(
    p_queue pgque.queue, p_group pgque.consumer_group, p_policy text, p_max_attempts integer,
    p_pause_timeout interval, p_max_retries integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_policy is null or p_policy not in ('skip', 'pause') then
        raise exception using errcode = '22023',
            message = format('failure policy must be ''skip'' or ''pause'', not %L',
                             pgque._name_for_message(p_policy));
    end if;
    if p_max_attempts < 1 then
        raise exception using errcode = '22023',
            message = format('max_attempts must be at least 1 (or null: no bound), not %s',
                             p_max_attempts);
    end if;
    if p_max_retries < 0 then
        raise exception using errcode = '22023',
            message = format('max_retries must not be negative (or null: the queue''s), not %s',
                             p_max_retries);
    end if;
    if p_pause_timeout <= interval '0' then
        raise exception using errcode = '22023',
            message = format('pause_timeout must be above zero (or null: no bound), not %s',
                             p_pause_timeout);
    end if;
    update pgque.consumer_group
       set cg_policy = p_policy, cg_max_attempts = p_max_attempts,
           cg_pause_timeout = p_pause_timeout, cg_max_retries = p_max_retries
     where cg_id = p_group.cg_id;
    if p_policy = 'skip' then
        update pgque.blocked_key b set bk_retry_at = now()
          from pgque.subscription s
         where s.sub_queue = p_queue.queue_id and b.bk_sub = s.sub_id
           and s.sub_consumer = any(array(
                   select pgque._slot_name(p_group.cg_consumer, k, p_group.cg_slots)
                     from generate_series(0, p_group.cg_slots - 1) k))
           and b.bk_retry_at > now();
    end if;
end
$$;

-- pgque.set_failure_policy(queue, consumer, policy, max_attempts,
-- pause_timeout, max_retries): what a failed event of consumer group consumer
-- does to its key: 'skip' (the default: it goes to the retry queue, the key
-- moves on, and after max_retries retries, the group's or else the queue's,
-- to the dead letters) or 'pause' (the key waits for it; see the top of this
-- file), with the bounds of a pause: after max_attempts failures of the head,
-- or once it blocked its key for pause_timeout, the head goes to the dead
-- letters (null: no bound).
-- Those who may use the group may set it. PQ002 for a group that is not
-- subscribed, PQ014 for a role that may not use it, 22023 for bad values.
create or replace function pgque.set_failure_policy(
    p_queue text, p_consumer text, p_policy text, p_max_attempts integer default 10,
    p_pause_timeout interval default interval '1 hour', p_max_retries integer default null)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    perform pgque._set_policy(v_queue, pgque._group(v_queue, p_consumer, null), p_policy,
                              p_max_attempts, p_pause_timeout, p_max_retries);
end
$$;

-- pgque.failure_policy(queue, consumer): consumer group consumer's failure
-- policy and the bounds of a pause (null: none). PQ002 for a group that is
-- not subscribed, PQ014 for a role that may not use it.
create or replace function pgque.failure_policy(
    p_queue text, p_consumer text,
    out policy text, out max_attempts integer, out pause_timeout interval,
    out max_retries integer)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_group pgque.consumer_group := pgque._group(pgque._queue_row(p_queue), p_consumer, null);
begin
    policy := v_group.cg_policy;
    max_attempts := v_group.cg_max_attempts;
    pause_timeout := v_group.cg_pause_timeout;
    max_retries := v_group.cg_max_retries;
end
$$;

-- pgque.blocked_keys(queue, consumer): the blocked keys of consumer group
-- consumer, by slot and key: each with its head (the event that failed),
-- how often it failed, its first and last error, since when it blocks the
-- key, when it is due again, and how many events are held behind it. PQ002
-- for a group that is not subscribed, PQ014 for a role that may not use it.
create or replace function pgque.blocked_keys(p_queue text, p_consumer text)
returns table (slot integer, key text, ev_id bigint, ev_time timestamptz, ev_type text,
               ev_data text, attempts integer, first_error text, last_error text,
               blocked_since timestamptz, last_failure timestamptz, retry_at timestamptz,
               held_behind bigint)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
begin
    return query
        select k, b.bk_key, h.ev_id, h.ev_time, h.ev_type, h.ev_data, b.bk_attempts,
               b.bk_first_error, b.bk_last_error, b.bk_since, b.bk_last_failure,
               b.bk_retry_at,
               (select count(*) from pgque.held_event x
                 where x.he_sub = b.bk_sub and x.he_key = b.bk_key
                   and x.he_seq > h.he_seq)
          from generate_series(0, v_group.cg_slots - 1) k
          join pgque.subscription s
            on s.sub_queue = v_queue.queue_id
           and s.sub_consumer = pgque._slot_name(v_group.cg_consumer, k, v_group.cg_slots)
          join pgque.blocked_key b on b.bk_sub = s.sub_id
         cross join lateral (select x.* from pgque.held_event x
                              where x.he_sub = b.bk_sub and x.he_key = b.bk_key
                                and x.he_seq > b.bk_done_seq
                              order by x.he_seq limit 1) h
         order by k, b.bk_key;
end
$$;

-- pgque._blocked_marker(queue, consumer, key, action): for the ledger's verbs:
-- the group, the slot subscription of key (by the routing) under its receive
-- lock, and the key's marker, locked; the caller may use the group (PQ014)
-- and the key is blocked (PQ027), its head not handed out to the slot's owner
-- now (PQ028: a worker handles it; act after its ack). A piece handed out to
-- a session that no longer owns the slot is void: the next owner gets a new
-- one. action names the verb for messages.
create or replace function pgque._blocked_marker(
    p_queue text, p_consumer text, p_key text, p_action text,
    out queue pgque.queue, out grp pgque.consumer_group, out sub pgque.subscription,
    out marker pgque.blocked_key)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    queue := pgque._queue_row(p_queue);
    grp := pgque._group(queue, p_consumer, null);
    select * into v from pgque._find_subscription(
        queue, pgque._slot_name(p_consumer, pgque.slot_of(p_key, grp.cg_slots), grp.cg_slots),
        true);
    sub := v.sub;
    select * into marker from pgque.blocked_key b
     where b.bk_sub = sub.sub_id and b.bk_key = p_key
       for update;
    if not found then
        raise exception using errcode = 'PQ027',
            message = format('cannot %s: key %L is not blocked in consumer group %L of queue %L',
                             p_action, pgque._name_for_message(p_key),
                             pgque._name_for_message(p_consumer), queue.queue_name);
    end if;
    if marker.bk_batch is not null then
        if exists (select from pgque._key_sessions(sub.sub_lock_key) k
                    where k.granted and k.mode = 'ExclusiveLock'
                      and pgque._may_consume(k.role, queue, grp.cg_owner, grp.cg_grantees)) then
            raise exception using errcode = 'PQ028',
                message = format('cannot %s: the head of key %L is handed out now (batch %s); '
                                 'try again once it is acked', p_action,
                                 pgque._name_for_message(p_key), marker.bk_batch);
        end if;
        -- Its owner is gone: the piece is void, the next owner gets a new one.
        update pgque.blocked_key b set bk_batch = null, bk_handed_seq = null, bk_epoch = null
         where b.bk_sub = sub.sub_id and b.bk_batch = marker.bk_batch;
        marker.bk_batch := null;
        marker.bk_handed_seq := null;
        marker.bk_epoch := null;
    end if;
end
$$;

-- pgque._head_of(marker): the marker's head, its first held event not handled.
create or replace function pgque._head_of(p_marker pgque.blocked_key)
returns pgque.held_event
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select h.* from pgque.held_event h
     where h.he_sub = p_marker.bk_sub and h.he_key = p_marker.bk_key
       and h.he_seq > p_marker.bk_done_seq
     order by h.he_seq limit 1
$$;

-- pgque.retry_head(queue, consumer, key): the blocked key's head is due now:
-- the slot's next receive hands it out (its attempts go on counting). PQ027
-- unless the key is blocked in the group, PQ028 while its head is handed
-- out, PQ014 for a role that may not use the group.
create or replace function pgque.retry_head(p_queue text, p_consumer text, p_key text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._blocked_marker(p_queue, p_consumer, p_key, 'retry the head');
    update pgque.blocked_key b set bk_retry_at = now()
     where b.bk_sub = (v.marker).bk_sub and b.bk_key = p_key;
end
$$;

-- pgque.skip_head(queue, consumer, key, reason): the blocked key's head goes
-- to the dead letters (with reason, else its last error) and the key moves
-- on: its held events are handed out next. Returns the head's ev_id. Errors
-- as retry_head.
create or replace function pgque.skip_head(p_queue text, p_consumer text, p_key text,
                                           p_reason text default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._blocked_marker(p_queue, p_consumer, p_key, 'skip the head');
    return pgque._kill_head(v.queue, v.sub, v.marker,
                            coalesce(p_reason, (v.marker).bk_last_error));
end
$$;

-- pgque.resume_key(queue, consumer, key): the blocked key moves on without
-- waiting for its head: the head goes to the slot's retry queue, as under
-- 'skip' (so it comes back after the key's later events), and the held
-- events are handed out next. Returns the head's ev_id. Errors as retry_head.
create or replace function pgque.resume_key(p_queue text, p_consumer text, p_key text)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_head pgque.held_event;
begin
    select * into v from pgque._blocked_marker(p_queue, p_consumer, p_key, 'resume the key');
    v_head := pgque._head_of(v.marker);
    insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time, ev_retry,
                                   ev_type, ev_data, ev_extra1, ev_delayed_id, rq_part)
    values (now(), (v.queue).queue_id, (v.sub).sub_id, v_head.ev_id, v_head.ev_time,
            v_head.ev_retry + (v.marker).bk_attempts, v_head.ev_type, v_head.ev_data, p_key,
            v_head.ev_delayed_id, pgque._write_part('retry'));
    v.marker.bk_done_seq := v_head.he_seq;
    v.marker.bk_attempts := 0;
    v.marker.bk_retry_at := now();
    perform pgque._save_marker(v.marker);
    return v_head.ev_id;
end
$$;

-- pgque._hold_first(sub, cur, dead): puts dead letter dead back as the next
-- event of its key in the slot subscription sub (locked by the caller, its
-- cursor cur): before every event of the key the slot has not handed out yet.
-- When the key is blocked, it becomes the head, ahead of what is held (whose
-- pending rows are copied behind it: rows are never updated); when not, the
-- key is blocked from the slot's next unread event on, with it as the head,
-- due now. Its retry count starts again at 0. PQ028 while the key's piece of
-- held events is handed out.
create or replace function pgque._hold_first(p_sub pgque.subscription, p_cur pgque.cursor,
                                             p_dead pgque.dead_letter)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_marker pgque.blocked_key;
    v_blocked boolean;
    v_part smallint := pgque._write_part('held');
    v_seq bigint := nextval('pgque.held_seq');
begin
    select * into v_marker from pgque.blocked_key b
     where b.bk_sub = p_sub.sub_id and b.bk_key = p_dead.ev_extra1
       for update;
    v_blocked := found;
    if v_blocked and v_marker.bk_batch is not null then
        raise exception using errcode = 'PQ028',
            message = format('cannot replay dead letter %s as the next event of key %L: the '
                             'key''s head is handed out now (batch %s); try again once it is '
                             'acked', p_dead.dl_id, pgque._name_for_message(p_dead.ev_extra1),
                             v_marker.bk_batch);
    end if;
    insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                  ev_retry, ev_type, ev_data, he_part)
    values (p_sub.sub_id, p_dead.ev_extra1, v_seq, 0, p_dead.ev_id, p_dead.ev_time,
            p_dead.ev_txid, 0, p_dead.ev_type, p_dead.ev_data, v_part);
    if v_blocked then
        -- What was pending follows it, copied with new numbers; the old rows
        -- fall below bk_done_seq, done.
        insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                      ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
        select h.he_sub, h.he_key, nextval('pgque.held_seq'), h.he_batch, h.ev_id, h.ev_time,
               h.ev_txid, h.ev_retry, h.ev_type, h.ev_data, h.ev_delayed_id, v_part
          from (select x.* from pgque.held_event x
                 where x.he_sub = p_sub.sub_id and x.he_key = p_dead.ev_extra1
                   and x.he_seq > v_marker.bk_done_seq and x.he_seq < v_seq
                 order by x.he_seq) h;
        update pgque.blocked_key b
           set bk_done_seq = v_seq - 1, bk_attempts = 0, bk_retry_at = now(), bk_since = now(),
               bk_first_error = null, bk_last_error = null, bk_last_failure = null
         where b.bk_sub = p_sub.sub_id and b.bk_key = p_dead.ev_extra1;
        return;
    end if;
    -- Not blocked: held from the slot's next unread event of its log on (in its
    -- open batch after what was handed out, else from the next batch).
    insert into pgque.blocked_key (bk_sub, bk_key, bk_from_batch, bk_from_ev, bk_done_seq,
                                   bk_attempts, bk_retry_at, bk_since)
    values (p_sub.sub_id, p_dead.ev_extra1,
            coalesce(p_cur.cur_batch, pg_sequence_last_value('pgque.batch_id_seq'), 0),
            case when p_cur.cur_batch is not null then coalesce(p_cur.cur_handed, 0) + 1
                 else 9223372036854775807 end,
            v_seq - 1, 0, now(), now());
end
$$;

-- ===== code/slots/receive.sql =====
-- pgque: receiving, acking and nacking one slot of a group.

-- pgque._slot_read_ahead(queue, sub, cur, slot, slots, max_events): for a
-- slot's cursor cur with no open batch, read before any lock: the tick that
-- would close its next batch (next_tick), and that batch's first events as
-- _receive would read them (events); idle is true when there are none, the
-- next tick is the queue's newest, and the last tick is less than
-- _slot_cursor_lag() old (by the database clock). receive_partitioned then
-- returns without locking or writing anything, instead of consuming the
-- empty batch: with N slots, most slots find nothing in most ticks at low
-- rates, and a cursor write with its commit per slot per tick was most of
-- what a group cost. Otherwise _receive uses the events read here if the
-- cursor is still at the same tick once locked: the events between two
-- existing ticks never change, so they need no lock, and a slot with work
-- reads its batch once. Read-only. With an open batch: all null.
create or replace function pgque._slot_read_ahead(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor,
    p_slot integer, p_slots integer, p_max_events integer,
    out idle boolean, out next_tick bigint, out events pgque.event_template[])
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_last pgque.tick;
begin
    idle := false;
    if p_cur.cur_batch is not null then
        return;
    end if;
    next_tick := pgque._next_tick(p_queue, p_cur);
    select * into v_last from pgque.tick
     where tick_queue = p_queue.queue_id and tick_id = p_cur.cur_last_tick;
    if next_tick is null or v_last.tick_id is null then
        return;
    end if;
    events := pgque._batch_events(p_queue.queue_id, p_sub.sub_id, v_last.tick_snapshot,
                                  pgque._tick_snapshot(p_queue.queue_id, next_tick),
                                  0, null, pgque._events_asked(p_max_events), null,
                                  p_slot, p_slots);
    idle := cardinality(events) = 0
            and next_tick = (pgque._last_tick(p_queue.queue_id)).tick_id
            and now() - v_last.tick_time < pgque._slot_cursor_lag();
end
$$;

-- pgque._slot_cursor_lag(): how old a slot's last tick may get while no event
-- of the slot came in, before receive_partitioned moves its cursor to the
-- newest tick (writing it). Bounds the ticks and event tables kept for idle
-- slots, and the lag that monitoring shows for them, also on a queue that
-- stopped ticking.
create or replace function pgque._slot_cursor_lag()
returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select interval '1 second' $$;

-- pgque._receive_slot(queue, grp, slot, sub, cur, max_events): the receive of
-- slot slot of group grp, whose subscription sub and cursor cur were read
-- without a lock: returns nothing when the session does not own the slot
-- (PQ024 instead), when there is nothing to receive (taking no lock and
-- writing nothing: an idle poll), or while the previous owner's fenced
-- transaction is open; else opens or continues the slot's batch under the
-- receive lock and returns its piece with the owner's epoch (slots/fence.sql).
-- The caller checked max_events and the group's access.
create or replace function pgque._receive_slot(
    p_queue pgque.queue, p_group pgque.consumer_group, p_slot integer,
    p_sub pgque.subscription, p_cur pgque.cursor, p_max_events integer)
returns setof pgque.batch_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
    v_epoch bigint;
    v_idle boolean;
    v_ahead_next bigint;
    v_ahead pgque.event_template[];
    v_held boolean;
begin
    -- Ownership before the row lock, so a non-owner never waits; then
    -- whether there is anything to receive, so an idle poll writes nothing:
    -- a piece of held events due (slots/pause.sql), or of the log.
    perform pgque._require_owner(p_sub);
    v_held := pgque._held_due(p_sub.sub_id);
    if not v_held then
        if not pgque._has_next_tick(p_queue.queue_id, p_cur) then
            return;  -- idle: no lock taken, nothing written
        end if;
        select * into v_idle, v_ahead_next, v_ahead
          from pgque._slot_read_ahead(p_queue, p_sub, p_cur, p_slot, p_group.cg_slots,
                                      p_max_events);
        if v_idle then
            return;  -- likewise
        end if;
    end if;
    -- Before the receive lock. Null while a transaction fenced by the previous
    -- owner's epoch is still open: nothing is handed out until it ends.
    v_epoch := pgque._slot_epoch(p_sub);
    if v_epoch is null then
        return;
    end if;
    select f.sub, f.cur into v from pgque._find_subscription(p_queue, p_sub.sub_consumer, true) f;
    perform pgque._require_owner(v.sub);  -- the key may have been renewed meanwhile
    if (v.cur).cur_batch is not null or (v.cur).cur_last_tick <> p_cur.cur_last_tick then
        v_ahead := null;  -- the cursor moved meanwhile: what was read ahead is not its batch
    end if;
    -- Held events first, unless the piece of the log handed out is not acked.
    if v_held and not pgque._log_piece_open(v.cur) then
        return query select * from pgque._receive_held(p_queue, p_group, v.sub, p_max_events,
                                                        v_epoch, p_slot);
        if found then
            return;
        end if;
    end if;
    return query select r.batch_id, r.ev_id, r.ev_time, r.ev_retry, r.ev_type, r.ev_data,
                        r.ev_extra1, v_epoch, r.slot, r.delayed_id
                   from pgque._receive(p_queue, v.sub, v.cur, p_max_events, p_slot,
                                       p_group.cg_slots, v_ahead, v_ahead_next) r;
end
$$;

-- pgque.receive_partitioned(queue, consumer, slot, slots, max_events): like
-- receive(), for slot slot of slots of a consumer group: opens the slot's
-- batch under the receive lock and returns only the events whose key routes
-- to the slot, with the owner's epoch (see slots/fence.sql). Refuses (PQ024)
-- unless this session owns the slot.
create or replace function pgque.receive_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer,
    p_max_events integer default null)
returns setof pgque.batch_event
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, false);
    return query select * from pgque._receive_slot(v.queue, v.grp, p_slot, v.sub, v.cur,
                                                    p_max_events);
end
$$;

-- pgque.ack_partitioned(queue, consumer, slot, slots, batch_id): ack() for a
-- slot; refuses (PQ024) unless this session owns the slot.
create or replace function pgque.ack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._slot_nack_ack(v.queue, v.grp, v.sub, v.cur, p_batch_id, null, null,
                                interval '0', p_slot);
end
$$;

-- pgque.ack_partitioned(queue, consumer, slot, slots, batch_id, nack_ids,
-- nack_reasons, retry_after): for a slot, nacks the given handed-out events
-- and acks the batch piece in one transaction (see the plain ack with nacks);
-- refuses (PQ024) unless this session owns the slot.
create or replace function pgque.ack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._slot_nack_ack(v.queue, v.grp, v.sub, v.cur, p_batch_id, p_nack_ids,
                                p_nack_reasons, p_retry_after, p_slot);
end
$$;

-- pgque.ack_partitioned(queue, consumer, slot, slots, batch_id, nack_ids,
-- nack_reasons, retry_after, retry_afters, dead_ids): the same, with a delay
-- per failed event (retry_afters, one per nack id; a null one: retry_after)
-- and the failed events not to retry (dead_ids, among nack_ids: to the dead
-- letters now; under pause the key moves on).
create or replace function pgque.ack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval,
    p_retry_afters interval[], p_dead_ids bigint[])
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._slot_nack_ack(v.queue, v.grp, v.sub, v.cur, p_batch_id, p_nack_ids,
                                p_nack_reasons, p_retry_after, p_slot, p_retry_afters,
                                p_dead_ids);
end
$$;

-- pgque._ack_receive_slot(queue, consumer, slot, slots, batch_id, nack_ids,
-- nack_reasons, retry_after, retry_afters, dead_ids, max_events): what
-- ack_receive_partitioned does (below): ack_partitioned of the
-- slot's batch piece (with its nacks; none when nack_ids is empty or null),
-- then receive_partitioned of the same slot, in one call and one transaction:
-- a consumer that works a slot piece after piece pays one round trip and one
-- commit per piece instead of two. Returns the next piece as
-- receive_partitioned does; nothing when there is none, or when this session
-- released and claimed the slot again since the piece (receive_partitioned
-- then takes the new epoch). Refuses what either
-- refuses (PQ024 unless this session owns the slot, PQ003 for a batch that is
-- not the open one); an error undoes both, the ack included.
create or replace function pgque._ack_receive_slot(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval,
    p_retry_afters interval[], p_dead_ids bigint[], p_max_events integer)
returns setof pgque.batch_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
    v_cur pgque.cursor;
    v_epoch bigint;
    v_held boolean;
begin
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    perform pgque._slot_nack_ack(v.queue, v.grp, v.sub, v.cur, p_batch_id, p_nack_ids,
                                 p_nack_reasons, p_retry_after, p_slot, p_retry_afters,
                                 p_dead_ids);
    -- The receive, from the cursor the ack wrote, under the receive lock the
    -- ack took. Its epoch is the one this session took for the piece just
    -- acked; when it has none (it released and claimed the slot again since),
    -- nothing is received here: receive_partitioned takes a new epoch, before
    -- the receive lock, as it must.
    v_cur := pgque._current_cursor((v.sub).sub_id);
    v_held := pgque._held_due((v.sub).sub_id) and not pgque._log_piece_open(v_cur);
    if not v_held and not pgque._has_next_tick((v.queue).queue_id, v_cur) then
        return;
    end if;
    v_epoch := pgque._held_epoch(v.sub);
    if v_epoch is null then
        return;
    end if;
    if v_held then
        return query select * from pgque._receive_held(v.queue, v.grp, v.sub, p_max_events,
                                                        v_epoch, p_slot);
        if found then
            return;
        end if;
    end if;
    return query select r.batch_id, r.ev_id, r.ev_time, r.ev_retry, r.ev_type, r.ev_data,
                        r.ev_extra1, v_epoch, r.slot, r.delayed_id
                   from pgque._receive(v.queue, v.sub, v_cur, p_max_events, p_slot,
                                       (v.grp).cg_slots) r;
end
$$;

-- pgque.ack_receive_partitioned(queue, consumer, slot, slots, batch_id,
-- nack_ids, nack_reasons, retry_after, max_events): _ack_receive_slot with
-- one delay for every failed event.
create or replace function pgque.ack_receive_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval,
    p_max_events integer default null)
returns setof pgque.batch_event
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select * from pgque._ack_receive_slot(p_queue, p_consumer, p_slot, p_slots, p_batch_id,
                                          p_nack_ids, p_nack_reasons, p_retry_after, null,
                                          null, p_max_events)
$$;

-- pgque.ack_receive_partitioned(queue, consumer, slot, slots, batch_id,
-- nack_ids, nack_reasons, retry_after, retry_afters, dead_ids, max_events):
-- the same, with a delay per failed event (retry_afters, one per nack id; a
-- null one: retry_after) and the failed events not to retry (dead_ids: to the
-- dead letters now, under pause the key moves on).
create or replace function pgque.ack_receive_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval,
    p_retry_afters interval[], p_dead_ids bigint[], p_max_events integer)
returns setof pgque.batch_event
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select * from pgque._ack_receive_slot(p_queue, p_consumer, p_slot, p_slots, p_batch_id,
                                          p_nack_ids, p_nack_reasons, p_retry_after,
                                          p_retry_afters, p_dead_ids, p_max_events)
$$;

-- pgque.nack_partitioned(queue, consumer, slot, slots, batch_id, ev_ids,
-- retry_after, reason): nack() for a slot (skip policy: the events go to the
-- slot's retry queue, the batch goes on); refuses (PQ024) unless this session
-- owns the slot.
create or replace function pgque.nack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_ev_ids bigint[], p_retry_after interval default '0', p_reason text default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_queue pgque.queue;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    if p_batch_id is distinct from (v.cur).cur_batch
       and exists (select from pgque.blocked_key b
                    where b.bk_sub = (v.sub).sub_id and b.bk_batch = p_batch_id) then
        raise exception using errcode = 'PQ029',
            message = format('batch %s is a piece of held events: nack its events with its ack '
                             '(ack_partitioned with nack_ids)', p_batch_id);
    end if;
    -- Retries under skip count against the group's max_retries when it has one.
    v_queue := v.queue;
    v_queue.queue_max_retries := coalesce((v.grp).cg_max_retries, v_queue.queue_max_retries);
    if (v.grp).cg_policy = 'pause' then
        return pgque._block_keys(v_queue, v.grp, v.sub, v.cur, p_batch_id, p_ev_ids,
                                 array[p_reason], p_retry_after, p_slot);
    end if;
    return pgque._nack(v_queue, v.sub, v.cur, p_batch_id, p_ev_ids, array[p_reason],
                       p_retry_after, p_slot, (v.grp).cg_slots);
end
$$;

-- ===== code/slots/session.sql =====
-- pgque: pinned sessions.
--
-- Slot ownership and the ticker election are session advisory locks: they
-- mean something only while every call of a client reaches the same server
-- session. Behind a transaction-mode pooler (PgBouncer and the like) one
-- client's calls may run on different server sessions, and one server session
-- may serve several clients in turn, so a lock belongs to whoever happens to
-- be there. A client that relies on its session pins it once (pin_session,
-- with a random token) and passes a value of every such call through
-- session_checked, which raises PQ025 as soon as the call runs on another
-- backend, or on a backend that another client has pinned since.
--
-- The token is a session setting, so a rollback of the transaction that pinned
-- (or a later RESET ALL / DISCARD ALL) takes it off the session while the client
-- still holds its pin. A missing token on the pinned backend is therefore no
-- sign of another client (one that pins sets a token of its own): the check
-- passes and puts the token back. Whatever session locks such a reset (or the
-- end of a backend whose pid came round again) took away, the slot and ticker
-- calls notice through their own lock checks.

-- pgque.pin_session(token): records token as this server session's owner (a
-- session-level setting) and returns the backend pid; the pair identifies the
-- session for session_checked. Raises 22023 for a token that is null, empty
-- or longer than 64 characters.
create or replace function pgque.pin_session(p_token text)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if p_token is null or length(p_token) not between 1 and 64 then
        raise exception using errcode = '22023',
            message = 'a session token must have 1 to 64 characters';
    end if;
    perform set_config('pgque.session_token', p_token, false);
    return pg_backend_pid();
end
$$;

-- pgque.session_checked(value, pid, token): returns value when this call runs
-- on backend pid and that backend is pinned with token, or carries no token at
-- all (a rollback or RESET undid the pin on this very session: the token is
-- set again, for the session, so it comes back with this call's transaction);
-- raises PQ025 on another backend, or when the backend carries another token
-- (another client pinned it since). Callers wrap an argument of the call that
-- needs the session in it, so the check and the call are one statement: either
-- both happen on the pinned session, or neither takes effect.
create or replace function pgque.session_checked(p_value text, p_pid integer, p_token text)
returns text
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_token text := coalesce(current_setting('pgque.session_token', true), '');
begin
    if v_token = '' and pg_backend_pid() = p_pid
       and length(p_token) between 1 and 64 then
        perform set_config('pgque.session_token', p_token, false);
        v_token := p_token;
    end if;
    if pg_backend_pid() is distinct from p_pid or v_token is distinct from p_token then
        raise exception using errcode = 'PQ025',
            message = format('the server session behind this connection changed (backend %s, '
                             'pinned %s): is a transaction-mode pooler in between?',
                             pg_backend_pid(), p_pid),
            hint = 'Slot ownership and the ticker election are session locks: connect '
                   'directly, or through a pooler in session mode.';
    end if;
    return p_value;
end
$$;

-- ===== code/slots/sets.sql =====
-- pgque: receiving and acking several slots of a group in one call.
--
-- A session that owns many slots (a worker with few lanes, a consumer that
-- drains a whole group) would otherwise make a receive and an ack per slot:
-- two round trips, two commits and the queue and group lookups, times the
-- slots. These do the same per slot, with the same checks, in one statement
-- each, as Kafka's poll returns the records of every assigned partition.
-- Each slot's piece is the one receive_partitioned would return; nothing
-- about order or ownership changes.
--
-- The usual case is set-based: slots drained together have no open batch
-- and their next batches end at the same tick (the queue's newest, as a rule),
-- even when they start at different ticks (a slot that found nothing in the
-- last ticks leaves its cursor where it was: see _slot_read_ahead). One read
-- of the span from the oldest of their starts holds every slot's events; each
-- event is routed to its slot with the routing formula, and kept for it only
-- if it came after that slot's own start; their cursors are written in one
-- statement, and when every slot asked for goes together, their epochs and
-- locks are taken in one statement each too. A slot with nothing in its span
-- that receive_partitioned would leave unwritten (the idle rule of
-- _slot_read_ahead) costs nothing more. A slot with an open batch, whose
-- batch would end at another tick, with blocked keys, or with nothing in its
-- span that receive_partitioned would consume, takes the slot-by-slot path
-- instead, and so do all of them when they are less than half of the group
-- (the read of the whole span would then cost more than theirs). Both paths
-- hand out the same pieces and write the same cursors
-- (tests/test_slot_sets_model.py).

-- pgque._owned_slot_subs(queue, grp, slot_list): the slots of slot_list
-- ascending (ks), with their subscriptions and cursors as _slot_subs reads
-- them (nulls for an empty list), each slot owned by this session (PQ024 for
-- the first that is not: receive_partitioned's first check, for all of them,
-- before anything is received).
create or replace function pgque._owned_slot_subs(
    p_queue pgque.queue, p_group pgque.consumer_group, p_slot_list integer[],
    out ks integer[], out subs pgque.subscription[], out curs pgque.cursor[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    select array_agg(t.slot order by t.slot), array_agg(t.sub order by t.slot),
           array_agg(t.cur order by t.slot)
      into ks, subs, curs
      from pgque._slot_subs(p_queue, p_group, p_slot_list) t;
    perform pgque._require_owner(subs[i]) from generate_subscripts(subs, 1) i;
end
$$;

-- pgque._slot_span(queue, grp, ks, subs, curs, max_events): the plan of
-- the set-based path of receive_slots for slots ks of group grp (their
-- subscriptions and cursors as read without a lock): which of them can go
-- together, and the one read of their next batch. Those that can: no open
-- batch, and the tick that would end their next batch (_next_tick: next_tick)
-- the one most of them share, and only when they are at least half of the
-- group (else each slot's own read, by its slot index, costs less). together
-- holds their positions in ks (none: the read is null), lasts their last
-- ticks at the same positions; last_tick is the oldest of those. req is the
-- read request of their span from last_tick (_span_rows), which the
-- caller runs and routes (_route_span); when their last ticks differ it
-- carries each slot's start in probe_prevs (an event is a slot's only if
-- that snapshot did not see it) and reads the span whole.
create or replace function pgque._slot_span(
    p_queue pgque.queue, p_group pgque.consumer_group, p_ks integer[],
    p_subs pgque.subscription[], p_curs pgque.cursor[], p_max_events integer,
    out together integer[], out lasts bigint[], out last_tick bigint, out next_tick bigint,
    out req pgque.read_request)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_prev pg_snapshot;              -- the snapshot of their oldest last tick
    v_next pg_snapshot;
    v_newest pgque.tick := pgque._last_tick(p_queue.queue_id);
begin
    together := '{}';
    -- (A group of one slot has nothing to put together.)
    if p_group.cg_slots = 1 then
        return;
    end if;
    -- The tick ending each slot's next batch, computed once per distinct last
    -- tick (slots share a few); the slots of the one most of them share.
    with c as (select i, (p_curs[i]).cur_last_tick as lt
                 from generate_subscripts(p_ks, 1) i
                where (p_curs[i]).cur_batch is null),
         n as (select d.lt,
                      -- _next_tick's answer, in the usual case (the newest tick
                      -- is within ticker_max_count) without its range scan.
                      case when d.lt >= v_newest.tick_id then null
                           when v_newest.tick_event_seq
                                <= l.tick_event_seq + p_queue.queue_ticker_max_count
                           then v_newest.tick_id
                           else pgque._next_tick(p_queue, p_curs[d.i]) end as n
                 from (select c.lt, min(c.i) as i from c group by c.lt) d
                 -- (lateral: one probe of the tick's key per last tick, where a
                 -- join could read every tick)
                 left join lateral (select l.tick_event_seq from pgque.tick l
                                     where l.tick_queue = p_queue.queue_id
                                       and l.tick_id = d.lt) l on true)
    select array_agg(c.i order by c.i), n.n into together, next_tick
      from c join n on n.lt = c.lt
     where n.n is not null
     group by n.n order by count(*) desc, n.n desc limit 1;
    if together is null or cardinality(together) * 2 < p_group.cg_slots then
        together := '{}';
        return;
    end if;
    lasts := array(select (p_curs[i]).cur_last_tick from unnest(together) with ordinality t(i, o)
                    order by o);
    last_tick := (select min(l) from unnest(lasts) l);
    v_prev := pgque._tick_snapshot(p_queue.queue_id, last_tick);
    if v_prev is null then
        together := '{}';
        return;
    end if;
    v_next := pgque._tick_snapshot(p_queue.queue_id, next_tick);
    -- One read of their next batches, for the caller to run.
    req.prev_xmax := pg_snapshot_xmax(v_prev);
    req.prev_xip := array(select pg_snapshot_xip(v_prev));
    req.next_xmax := pg_snapshot_xmax(v_next);
    req.next := v_next;
    req.slots := p_group.cg_slots;
    req.max_events := pgque._events_asked(p_max_events);
    req.span_slots := array(select p_ks[i] from unnest(together) i);
    req.span_subs := array(select (p_subs[i]).sub_id from unnest(together) i);
    req.probe := false;
    if exists (select from unnest(lasts) l where l <> last_tick) then
        req.probe_prevs := array(select k.tick_snapshot
                                   from unnest(lasts) with ordinality t(l, o)
                                   join pgque.tick k on k.tick_queue = p_queue.queue_id
                                                    and k.tick_id = t.l
                                  order by t.o);
        -- Read whole: a slot's first max_events of the span may be events an
        -- older start holds and its own start saw.
        req.max_events := null;
    end if;
end
$$;

-- pgque._route_span(events, req, max_events): the span's events (read for the
-- read request req of _slot_span) routed to their slots: each event's slot
-- among req.span_slots by slot_of's formula, written out (a call per event
-- would cost more than the rest of receive_slots), a retried event to its
-- owner's slot only, an event to a slot only if the slot's start
-- (req.probe_prevs, when given) did not see it (-1: none of them); the slots that have events, ascending,
-- and for each how many, the last one's ev_id and the last ev_id of the first
-- piece (max_events; without it, the last one). The events come as an
-- argument, not in a record: they are read once per row below.
create or replace function pgque._route_span(
    p_events pgque.event_template[], p_req pgque.read_request, p_max_events integer,
    out routes integer[], out with_events integer[], out counts bigint[], out lasts bigint[],
    out handed bigint[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_slots integer := p_req.slots;
    v_span_slots integer[] := p_req.span_slots;
    v_span_subs integer[] := p_req.span_subs;
begin
    if coalesce(cardinality(p_events), 0) = 0 then
        return;  -- nothing to route (an idle poll): no query
    end if;
    routes := array(
        select coalesce(o.k, -1)
          from unnest(p_events) with ordinality as e
          left join unnest(v_span_slots, v_span_subs, p_req.probe_prevs) as o(k, sub, prev)
            on o.k = case when e.ev_extra1 is null then 0
                          else (hashtextextended(e.ev_extra1, 0) % v_slots
                                + v_slots) % v_slots end
           and (e.ev_owner is null or e.ev_owner = o.sub)
           and (o.prev is null or not pg_visible_in_snapshot(e.ev_txid, o.prev))
         order by e.ordinality);
    select array_agg(p.k order by p.k), array_agg(p.n order by p.k),
           array_agg(p.last order by p.k)
      into with_events, counts, lasts
      from (select routes[e.ordinality] as k, count(*) as n, max(e.ev_id) as last
              from unnest(p_events) with ordinality as e
             where routes[e.ordinality] >= 0
             group by 1) p;
    -- Each slot's piece ends at its last event, or at its max_events-th by
    -- ev_id when it has more (pieces: only then are the events ordered).
    handed := lasts;
    if p_max_events < any(counts) then
        handed := array(
            select coalesce(m.ev_id, w.last)
              from unnest(with_events, lasts) with ordinality as w(k, last, i)
              left join (select r.k, r.ev_id
                           from (select routes[e.ordinality] as k, e.ev_id,
                                        row_number() over (partition by routes[e.ordinality]
                                                           order by e.ev_id) as n
                                   from unnest(p_events) with ordinality as e
                                  where routes[e.ordinality] >= 0) r
                          where r.n = p_max_events) m on m.k = w.k
             order by w.i);
    end if;
end
$$;

-- pgque._lock_span(subs, last_ticks): for a set-based receive of every slot of
-- subs at once: their epochs (_slot_epochs), then their receive locks in
-- ascending slot order with the owner checked on each row as locked (PQ024:
-- the key may have been renewed and the slot taken since the rows were read),
-- then their cursors read again; null unless every slot can go (none fenced,
-- every cursor still without an open batch at its tick of last_ticks).
create or replace function pgque._lock_span(
    p_subs pgque.subscription[], p_last_ticks bigint[],
    out epochs bigint[], out curs pgque.cursor[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_locked record;
    v_parts record;
begin
    epochs := pgque._slot_epochs(p_subs);
    if array_position(epochs, null) is not null then
        epochs := null;
        return;
    end if;
    for v_locked in select s from generate_subscripts(p_subs, 1) i
                      join pgque.subscription s on s.sub_id = (p_subs[i]).sub_id
                     order by i
                       for no key update of s loop
        perform pgque._require_owner(v_locked.s);
    end loop;
    perform pgque._write_part('cursor');  -- 40001 for a snapshot older than a switch
    v_parts := pgque._cursor_parts();
    -- _current_cursor, written out (as in _slot_subs).
    curs := array(select coalesce(c1.c, c2.c) from generate_subscripts(p_subs, 1) i
                   left join lateral (select o from pgque.cursor o
                                       where o.cur_part = v_parts.part
                                         and o.cur_sub = (p_subs[i]).sub_id
                                       order by o.cur_seq desc limit 1) c1(c) on true
                   left join lateral (select o from pgque.cursor o
                                       where c1.c is null and o.cur_part = v_parts.moved_from
                                         and o.cur_sub = (p_subs[i]).sub_id
                                       order by o.cur_seq desc limit 1) c2(c) on true
                   where (coalesce(c1.c, c2.c)).cur_batch is null
                     and (coalesce(c1.c, c2.c)).cur_last_tick = p_last_ticks[i]
                   order by i);
    if cardinality(curs) <> cardinality(p_subs) then
        epochs := null;
        curs := null;
    end if;
end
$$;

-- pgque._lock_span_slot(sub, last_tick): as _lock_span for one slot that
-- goes together with others while some slot of the call does not: its epoch
-- before its receive lock (null while a transaction fenced by the previous
-- owner's epoch is open: then the slot receives nothing), the owner again once
-- locked, and its cursor read again (a new statement, so a fresh snapshot);
-- ready unless the cursor moved since it was read (the slot then goes as
-- receive_partitioned would take it).
create or replace function pgque._lock_span_slot(
    p_sub pgque.subscription, p_last_tick bigint,
    out epoch bigint, out cur pgque.cursor, out ready boolean)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_locked record;
begin
    ready := false;
    epoch := pgque._slot_epoch(p_sub);
    if epoch is null then
        return;
    end if;
    select s into v_locked from pgque.subscription s where s.sub_id = p_sub.sub_id
       for no key update;
    perform pgque._require_owner(v_locked.s);  -- as locked: the key may be new
    cur := pgque._current_cursor(p_sub.sub_id);
    ready := coalesce(cur.cur_batch is null and cur.cur_last_tick = p_last_tick, false);
end
$$;

-- pgque.receive_slots(queue, consumer, slots, slot_list, max_events): for each
-- slot of slot_list (slots of a group of slots), what receive_partitioned
-- would return, ascending by slot; slots with nothing to receive return no
-- row. One transaction: a failure (PQ024 for a slot this session does not
-- own) receives nothing. max_events bounds each slot's piece. The rows are
-- pgque.batch_event's columns led by the slot, as clients of 0.3 read them
-- by position, then (since 0.8) ahead: whether the slot has more to receive
-- once this piece is acked (its batch goes on after the piece, or ends before
-- the queue's newest tick): a consumer draining a backlog receives again at
-- once; one that is not waits for the next tick.
create or replace function pgque.receive_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_max_events integer default null)
returns table (slot integer, batch_id bigint, ev_id bigint, ev_time timestamptz,
               ev_retry integer, ev_type text, ev_data text, ev_extra1 text, epoch bigint,
               delayed_id bigint, ahead boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_ks integer[];
    v_subs pgque.subscription[];
    v_curs pgque.cursor[];
    v_span record;                   -- _slot_span: the slots together and their read
    v_events pgque.event_template[]; -- that read's events,
    v_route record;                  --   routed to their slots (_route_span)
    v_locked record;
    v_all boolean := false;          -- every slot opened together
    v_open integer[] := '{}';        -- the slots opened together, their epochs and cursors
    v_epochs bigint[] := '{}';
    v_open_curs pgque.cursor[] := '{}';
    v_served record;                 -- their batches (_open_span_batches)
    v_routes integer[];
    v_batch_ids bigint[];
    v_handed bigint[];
    v_rest pgque.batch_event[] := '{}';  -- the rows of the other slots
    v_idle integer[] := '{}';        -- positions in ks of the slots left idle
    v_lasts bigint[];                -- the last ticks of the slots together
    v_newest pgque.tick;
    v_blocked integer[];             -- the subscriptions among them with a blocked key
    v_ahead integer[];               -- the slots of v_rest whose batch ends before the newest tick
    v_i integer;
    v_j integer;
begin
    perform pgque._check_max_events(p_max_events);
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    select * into v_ks, v_subs, v_curs from pgque._owned_slot_subs(v_queue, v_group, p_slot_list);
    if v_ks is null then
        return;  -- an empty list
    end if;
    -- A slot with no open batch, no tick after its last one and no blocked key
    -- has nothing to receive: as receive_partitioned does (_has_next_tick),
    -- it is left without a lock or a write. (Held events are due only where
    -- a key is blocked: see _held_due.)
    v_newest := pgque._last_tick(v_queue.queue_id);
    v_blocked := array(select distinct b.bk_sub from pgque.blocked_key b
                        where b.bk_sub = any(array(select (x).sub_id from unnest(v_subs) x)));
    v_idle := array(select i from generate_subscripts(v_ks, 1) i
                     where (v_curs[i]).cur_batch is null
                       and (v_curs[i]).cur_last_tick >= coalesce(v_newest.tick_id, 0)
                       and (v_subs[i]).sub_id <> all(v_blocked)
                     order by i);
    v_span := pgque._slot_span(v_queue, v_group, v_ks, v_subs, v_curs, p_max_events);
    if cardinality(v_span.together) > 0 then
        v_events := pgque._run_reader(v_queue.queue_id, v_span.req);
        v_route := pgque._route_span(v_events, v_span.req, p_max_events);
        -- A slot with nothing in its span is left as receive_partitioned
        -- leaves an idle slot (_slot_read_ahead's rule: its batch would end
        -- at the newest tick, its start is recent, no held events due):
        -- nothing received, nothing written. The other empty ones, and a slot
        -- with blocked keys (slots/pause.sql: its receive sets their events
        -- aside, or hands out held ones), go slot by slot.
        select v_idle || coalesce(array_agg(t.i order by t.o) filter (where t.idle), '{}'),
               coalesce(array_agg(t.i order by t.o) filter (where not t.idle and t.go), '{}'),
               coalesce(array_agg(t.l order by t.o) filter (where not t.idle and t.go), '{}')
          into v_idle, v_span.together, v_lasts
          from (select x.i, x.o, x.l, x.has and not x.blocked as go,
                       not x.has and not x.blocked and v_span.next_tick = v_newest.tick_id
                           and now() - k.tick_time < pgque._slot_cursor_lag() as idle
                  from (select t.i, t.o, t.l,
                               coalesce(v_ks[t.i] = any(v_route.with_events), false) as has,
                               (v_subs[t.i]).sub_id = any(v_blocked) as blocked
                          from unnest(v_span.together, v_span.lasts) with ordinality t(i, l, o)) x
                  left join pgque.tick k on k.tick_queue = v_queue.queue_id and k.tick_id = x.l
               ) t;
    else
        v_route := pgque._route_span('{}', null, null);  -- nothing to route
    end if;
    if cardinality(v_span.together) + cardinality(v_idle) = cardinality(v_ks)
       and cardinality(v_span.together) > 0 then
        -- Every slot goes together or is idle (a session draining its slots):
        -- one statement each for the epochs, the locks and the cursors.
        v_locked := pgque._lock_span(array(select v_subs[i] from unnest(v_span.together) i),
                                     v_lasts);
        if v_locked.epochs is not null then
            v_all := true;
            v_open := array(select v_ks[i] from unnest(v_span.together) i);
            v_epochs := v_locked.epochs;
            v_open_curs := v_locked.curs;
        end if;
    end if;
    -- Else slot after slot, ascending (the lock order everywhere): a slot that
    -- can go together is locked here and opened with the others below; an
    -- idle one is left; any other goes as receive_partitioned would take it.
    for v_i in 1 .. cardinality(v_ks) loop
        exit when v_all;  -- all opened together above
        continue when v_i = any(v_idle);
        v_j := array_position(v_span.together, v_i);
        if v_j is not null then
            v_locked := pgque._lock_span_slot(v_subs[v_i], v_lasts[v_j]);
            continue when v_locked.epoch is null;  -- fenced: nothing for this slot
            if v_locked.ready then
                v_open := v_open || v_ks[v_i];
                v_epochs := v_epochs || v_locked.epoch;
                v_open_curs := v_open_curs || v_locked.cur;
                continue;
            end if;
        end if;
        v_rest := v_rest || array(
            select r from pgque._receive_slot(v_queue, v_group, v_ks[v_i], v_subs[v_i],
                                              v_curs[v_i], p_max_events) r);
    end loop;
    -- The pieces of the slots opened together, read from the span's events
    -- (the arrays in variables: a record's field would be fetched per row),
    -- then the rows of the others, by slot and ev_id.
    if cardinality(v_open) > 0 then
        v_served := pgque._open_span_batches(v_route.with_events, v_route.counts, v_route.lasts,
                                             v_route.handed, v_span.next_tick, v_open,
                                             v_open_curs, p_max_events);
        v_routes := v_route.routes;
        v_batch_ids := v_served.batch_ids;
        v_handed := v_served.handed;
    end if;
    -- Ahead: the slot's batch goes on after this piece (max_events cut it),
    -- or ends before the newest tick. The batches opened together end at the
    -- span's tick; the others where their cursors now say (a piece of held
    -- events: no tick, ahead).
    v_ahead := array(select k from (select distinct x.slot as k from unnest(v_rest) x) r
                     cross join lateral pgque._current_cursor(
                         (v_subs[array_position(v_ks, r.k)]).sub_id, false) c
                     where coalesce(c.cur_next_tick < v_newest.tick_id
                                    or c.cur_end is null or c.cur_handed < c.cur_end, true));
    return query
        select s.k, s.batch_id, e.ev_id, e.ev_time, e.ev_retry, e.ev_type, e.ev_data,
               e.ev_extra1, s.epoch, e.ev_delayed_id,
               v_span.next_tick < v_newest.tick_id
               or v_route.counts[array_position(v_route.with_events, s.k)] > p_max_events
          from unnest(v_events) with ordinality as e
          join unnest(v_open, v_batch_ids, v_handed, v_epochs) as s(k, batch_id, handed, epoch)
            on s.k = v_routes[e.ordinality]
         where e.ev_id <= s.handed
        union all
        select x.slot, x.batch_id, x.ev_id, x.ev_time, x.ev_retry, x.ev_type, x.ev_data,
               x.ev_extra1, x.epoch, x.delayed_id, x.slot = any(v_ahead)
          from unnest(v_rest) x
         order by 1, 3;
end
$$;

-- pgque._open_span_batches(route, next_tick, open, epochs, curs, max_events):
-- opens the batch of each slot of open (with epochs and locked cursors curs,
-- at the same positions) over the span's read, as _slot_span planned it (its
-- routing by _route_span, and next_tick), as _receive does for one slot (a
-- batch id, a piece of at most max_events events, the batch's end once it
-- was read whole), with one cursor write for them all; returns, for each slot
-- of open, its batch id and the ev_id of its piece's last event. The caller
-- reads the rows of the pieces from the span's events.
create or replace function pgque._open_span_batches(
    p_with integer[], p_counts bigint[], p_lasts bigint[], p_handed bigint[],
    p_next_tick bigint, p_open integer[], p_curs pgque.cursor[], p_max_events integer,
    out batch_ids bigint[], out handed bigint[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_saved integer;
begin
    with served as (
        select t.n, nextval('pgque.batch_id_seq') as batch_id,
               p_counts[j.j] as count, p_lasts[j.j] as last, p_handed[j.j] as handed
          from unnest(p_open) with ordinality as t(k, n)
         cross join lateral (select array_position(p_with, t.k) as j) j
    ), saved as (
        insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                                  cur_pos, cur_handed, cur_end, cur_part)
        select (p_curs[s.n]).cur_sub, (p_curs[s.n]).cur_seq + 1,
               (p_curs[s.n]).cur_last_tick, s.batch_id, p_next_tick, 0, s.handed,
               case when p_max_events is null or s.count <= p_max_events then s.last end,
               (select pgque._write_part('cursor'))
          from served s
        on conflict do nothing
        returning 1
    )
    select array_agg(s.batch_id order by s.n), array_agg(s.handed order by s.n),
           (select count(*) from saved)
      into batch_ids, handed, v_saved
      from served s;
    if v_saved < coalesce(cardinality(p_open), 0) then
        perform pgque._cursor_moved();  -- a cursor written since it was read
    end if;
end
$$;

-- pgque.ack_slots(queue, consumer, slots, slot_list, batch_ids): acks, for each
-- slot of slot_list, the batch piece batch_ids names at the same position
-- (what ack_partitioned does for one), in one transaction, slots locked in
-- ascending order; returns, in the order given, whether each ack finished
-- its batch. Raises 22023 for a null list, a slot named twice or lists of
-- different lengths, PQ023 for a slot out of range, PQ024 for a slot this
-- session does not own, PQ003 for a batch that is not the slot's open one:
-- then nothing is acked.
create or replace function pgque.ack_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_batch_ids bigint[])
returns boolean[]
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_subs pgque.subscription[];
    v_curs pgque.cursor[];
    v_batch_ids bigint[];
    v_positions bigint[];
    v_done boolean[];
    v_held integer[] := '{}';  -- the positions of pieces of held events
    v_i integer;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    perform pgque._check_slot_list(v_group, p_slot_list);
    if p_batch_ids is null or cardinality(p_slot_list) <> cardinality(p_batch_ids) then
        raise exception using errcode = '22023',
            message = 'ack_slots: the batch ids must be as many as the slots';
    end if;
    -- The receive locks, in ascending slot order, in one statement; then (a
    -- new statement, so a fresh snapshot) the subscriptions and cursors, and
    -- for each slot ack_partitioned's checks.
    perform 1 from unnest(p_slot_list) k
      join pgque.subscription s
        on s.sub_queue = v_queue.queue_id
       -- _slot_name, written out (as in _slot_subs)
       and s.sub_consumer = v_group.cg_consumer || '#' || k::text || '/'
                            || v_group.cg_slots::text
     order by k
       for no key update of s;
    select array_agg(t.sub order by t.slot), array_agg(t.cur order by t.slot),
           array_agg(b.batch_id order by t.slot), array_agg(b.pos order by t.slot)
      into v_subs, v_curs, v_batch_ids, v_positions
      from pgque._slot_subs(v_queue, v_group, p_slot_list) t
      join unnest(p_slot_list, p_batch_ids) with ordinality as b(slot, batch_id, pos)
        on b.slot = t.slot;
    if v_subs is null then
        return '{}';  -- an empty list
    end if;
    for v_i in 1 .. cardinality(v_subs) loop
        perform pgque._require_owner(v_subs[v_i]);
        if (v_curs[v_i]).cur_sub is null then
            perform pgque._cursor_missing((v_subs[v_i]).sub_id);  -- 40001: an old snapshot
        end if;
        if v_batch_ids[v_i] is distinct from (v_curs[v_i]).cur_batch
           and exists (select from pgque.blocked_key b
                        where b.bk_sub = (v_subs[v_i]).sub_id
                          and b.bk_batch = v_batch_ids[v_i]) then
            v_held := v_held || v_i;  -- a piece of held events (slots/pause.sql)
        else
            perform pgque._require_batch(v_subs[v_i], v_curs[v_i], v_batch_ids[v_i]);
        end if;
    end loop;
    -- What _ack writes for one slot, for all of them in one statement (but
    -- the pieces of held events, acked one by one); each result goes where
    -- the slot was given.
    v_done := pgque._ack_cursors(array(select v_curs[t.i] from generate_subscripts(v_curs, 1) t(i)
                                        where t.i <> all(v_held) order by t.i));
    v_done := array(select case when t.i = any(v_held)
                                then pgque._ack_held(v_queue, v_group, v_subs[t.i], v_batch_ids[t.i],
                                                     null, null, interval '0')
                                else v_done[t.i - (select count(*) from unnest(v_held) h
                                                    where h < t.i)::integer] end
                      from generate_subscripts(v_curs, 1) t(i) order by t.i);
    select array_agg(v_done[t.i] order by v_positions[t.i]) into v_done
      from generate_subscripts(v_curs, 1) t(i);
    return v_done;
end
$$;

-- pgque.ack_receive_slots(queue, consumer, slots, ack_list, batch_ids,
-- receive_list, max_events): ack_slots of the pieces named (ack_list and
-- batch_ids at the same positions; empty lists: none), then receive_slots of
-- receive_list, in one transaction: what a session that serves many slots
-- does at each of its turns (the pieces its handlers finished, the slots it
-- wants more of) in one round trip and one commit. Errors as theirs; a
-- failure acks and receives nothing.
create or replace function pgque.ack_receive_slots(
    p_queue text, p_consumer text, p_slots integer, p_ack_list integer[],
    p_batch_ids bigint[], p_receive_list integer[], p_max_events integer default null)
returns table (slot integer, batch_id bigint, ev_id bigint, ev_time timestamptz,
               ev_retry integer, ev_type text, ev_data text, ev_extra1 text, epoch bigint,
               delayed_id bigint, ahead boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    -- The receive locks of both lists first, ascending by slot (the lock order
    -- of every call that locks several slots of a group); the calls below take
    -- them again.
    perform 1 from (select distinct k from unnest(p_ack_list || p_receive_list) k) x
      join pgque.subscription s
        on s.sub_queue = v_queue.queue_id
       and s.sub_consumer = v_group.cg_consumer || '#' || x.k::text || '/'
                            || v_group.cg_slots::text
     order by x.k
       for no key update of s;
    if cardinality(p_ack_list) > 0 or cardinality(p_batch_ids) > 0 then
        perform pgque.ack_slots(p_queue, p_consumer, p_slots, p_ack_list, p_batch_ids);
    end if;
    return query select * from pgque.receive_slots(p_queue, p_consumer, p_slots,
                                                   p_receive_list, p_max_events);
end
$$;

-- ===== code/generated/batch_reader.sql =====
-- pgque: batch readers, so that reading a batch is not planned on every call.
--
-- A queue's event tables are named after its id, so the statement that reads
-- a batch (_batch_events, consumers/read.sql) is dynamic SQL: parsed and planned at
-- every receive. Over the parent and its three children that planning costs
-- more than the read itself (about 0.6 ms against 0.3 ms for 100 events).
-- So every queue gets a generated function, its batch reader, holding the
-- same statements as static SQL: PL/pgSQL prepares a static statement once
-- per session and keeps its plan until a table it reads changes (a truncate,
-- an index built), so a receive then plans nothing.
--
-- The reader has one branch per slot count: the plain one (no routing
-- filter) and one for each count N above 1 that a group of the queue uses,
-- with N written out as a literal so that the plan can use the slot index
-- (generated/slot_index.sql). For any other count it returns one row of
-- nulls and the caller (_run_reader) reads with dynamic SQL, as
-- before: a reader that lags behind the groups is slower, never wrong. The
-- plain branch is always there. A reader returns its events as rows, which
-- receive hands on as they are (consumers/batch.sql); _run_reader collects
-- them into one array for everyone else.
--
-- Readers follow the protocol of generated code (generator.sql): create_queue
-- writes a queue's first one, maintenance writes it again when its groups'
-- slot counts change, drop_queue drops it (each when the generators' lock is
-- free, else maintenance does it next), every install writes it from the
-- current template. Generated from integers only: no caller text.


-- pgque._batch_reader_name(queue_id): the reader's function name (no schema;
-- internal, as its leading underscore tells install/grants.sql).
create or replace function pgque._batch_reader_name(p_queue_id integer)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return '_batch_reader_' || p_queue_id::text;
end
$$;

-- pgque._batch_reader_args(): the reader's parameter list: one read request
-- (pgque.read_request, consumers/read.sql), whose slot count picks the branch.
create or replace function pgque._batch_reader_args()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select 'p_read pgque.read_request'
$$;

-- pgque._batch_reader_source(queue_id, slot_counts): the body of the queue's
-- reader for the given slot counts above 1: for each count, and for plain
-- consumers and groups of one slot, what _read_dispatch writes for it (its
-- probe, its span reads and its read, here static).
create or replace function pgque._batch_reader_source(p_queue_id integer, p_slot_counts integer[])
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(E'-- For slot counts %s.\n'
                  'declare\n'
                  '    p_slots constant integer := p_read.slots;\n'
                  'begin\n'
                  '%s'
                  '    -- No branch for this slot count: the caller reads dynamically.\n'
                  '    return query select (null::pgque.event_template).*;\n'
                  'end\n',
                  array_to_string(array_prepend(1, p_slot_counts), ', '),
                  string_agg(format(E'    if p_slots %s then\n%s    end if;\n',
                                    case when n = 1 then 'is null or p_slots = 1'
                                         else '= ' || n::text end,
                                    regexp_replace(pgque._read_dispatch('p_read', p_queue_id, n),
                                                   E'^(?=.)', '        ', 'gn')),
                             '' order by n))
      from unnest(array_prepend(1, p_slot_counts)) n
$$;

-- pgque._batch_reader_signature(queue_id): the signature of the queue's
-- reader wanted now: for its groups' slot counts.
create or replace function pgque._batch_reader_signature(p_queue_id integer)
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._signature(p_queue_id || ':' || pgque._slot_counts_wanted(p_queue_id)::text)
$$;

-- pgque._batch_reader_due(queue_id): whether the queue's reader is missing
-- or was written for other slot counts than its groups use now. Read-only
-- (for _maint_due).
create or replace function pgque._batch_reader_due(p_queue_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._generated_due(pgque._batch_reader_name(p_queue_id),
                                pgque._batch_reader_signature(p_queue_id))
$$;

-- pgque._sync_batch_reader(queue_id, wait): writes the queue's reader for
-- its groups' slot counts unless it is current or (without wait) the
-- generators' lock is taken; returns 1 if it wrote it, else 0.
create or replace function pgque._sync_batch_reader(p_queue_id integer, p_wait boolean)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_signature text;
begin
    if not pgque._batch_reader_due(p_queue_id) or not pgque._lock_generators(p_wait) then
        return 0;
    end if;
    -- Read once locked: what a writer that committed meanwhile wrote counts.
    v_signature := pgque._batch_reader_signature(p_queue_id);
    if not pgque._generated_due(pgque._batch_reader_name(p_queue_id), v_signature) then
        return 0;
    end if;
    perform pgque._write_generated(
        pgque._batch_reader_name(p_queue_id), pgque._batch_reader_args(),
        'returns setof pgque.event_template language plpgsql stable'
        ' set search_path = pg_catalog, pg_temp set plan_cache_mode = force_generic_plan',
        v_signature,
        pgque._batch_reader_source(p_queue_id, pgque._slot_counts_wanted(p_queue_id)));
    return 1;
end
$$;

-- pgque._orphan_readers(): the names of the batch readers whose queue is
-- gone (drop_queue drops its reader only when the generators' lock is free).
create or replace function pgque._orphan_readers()
returns setof text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select p.proname::text from pg_proc p
     where p.pronamespace = 'pgque'::regnamespace and p.proname ~ '^_batch_reader_[0-9]+$'
       and not exists (select from pgque.queue q
                        where pgque._batch_reader_name(q.queue_id) = p.proname)
     order by 1
$$;

-- pgque._drop_orphan_readers(wait): drops the readers of dropped queues
-- under the generators' lock (without wait, only when it is free); returns
-- how many.
create or replace function pgque._drop_orphan_readers(p_wait boolean)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name text;
    v_dropped integer := 0;
begin
    if not exists (select from pgque._orphan_readers()) or not pgque._lock_generators(p_wait) then
        return 0;
    end if;
    for v_name in select * from pgque._orphan_readers() loop
        perform pgque._drop_generated(v_name);
        v_dropped := v_dropped + 1;
    end loop;
    return v_dropped;
end
$$;

-- ===== code/generated/event_writer.sql =====
-- pgque: the event writer, so that a send plans nothing.
--
-- A queue's event tables are named after its id, so send's INSERT used to be
-- dynamic SQL: parsed, analysed and planned on every call, about 30 µs of
-- server time in a transaction of one event, where the same INSERT written
-- statically costs 10. PL/pgSQL can call only a function whose name it knows
-- when it is compiled, so the writer is one function for every queue:
-- pgque._write_event, generated from pgque.queue, holding each event table's
-- INSERT as static SQL (prepared once per session, its plan kept until the
-- table changes). It picks the queue in a binary tree of IFs on the queue id,
-- then the table, so a send through it costs about the same whatever the
-- number of queues it holds.
--
-- It holds the first queues by id up to 512 event tables
-- (_event_writer_max_tables; about 170 queues of the default 3): each
-- session compiles the writer again at its first send after every change of
-- it, about 40 ms at 768 tables and 0.5 s at 3,000. A queue or table the
-- writer does not know (one beyond those, or one made since the writer was
-- last written) gets null back, and send inserts with dynamic SQL as before:
-- slower, never wrong.
--
-- It follows the protocol of generated code (generator.sql): create_queue and
-- drop_queue write it again when the generators' lock is free, and leave it
-- otherwise to maintenance (pgque.maint() of every queue, which the Ticker
-- runs every second, step `event_writer`); every install writes it. Generated
-- from integers only: no caller text.

-- pgque._event_writer_branches(queue_ids, table_counts, depth): the writer's
-- code for these queues, ascending by id: a binary tree of IFs on the queue
-- id down to a few queues, then one IF per queue and one per event table,
-- each with its static INSERT. Indented for depth.
create or replace function pgque._event_writer_branches(
    p_queue_ids integer[], p_table_counts integer[], p_depth integer)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count integer := coalesce(cardinality(p_queue_ids), 0);
    v_half integer := v_count / 2;
    v_pad text := repeat('    ', p_depth);
    v_code text := '';
    i integer;
    n integer;
begin
    if v_count > 4 then
        return format(E'%sif p_queue_id < %s then\n%s%selse\n%s%send if;\n',
                      v_pad, p_queue_ids[v_half + 1],
                      pgque._event_writer_branches(p_queue_ids[1:v_half], p_table_counts[1:v_half],
                                                   p_depth + 1),
                      v_pad,
                      pgque._event_writer_branches(p_queue_ids[v_half + 1:],
                                                   p_table_counts[v_half + 1:], p_depth + 1),
                      v_pad);
    end if;
    for i in 1 .. v_count loop
        v_code := v_code || format(E'%sif p_queue_id = %s then\n', v_pad, p_queue_ids[i]);
        for n in 0 .. p_table_counts[i] - 1 loop
            v_code := v_code || format(
                E'%s    if p_table = %s then\n'
                 '%s        %s into v_id;\n'
                 '%s        return v_id;\n'
                 '%s    end if;\n',
                v_pad, n, v_pad,
                pgque._event_insert(p_queue_ids[i], n,
                                    format('coalesce(p_id, nextval(%L::regclass))',
                                           'pgque.' || pgque._event_table(p_queue_ids[i])
                                           || '_id_seq'),
                                    'p_type, p_data, p_key'),
                v_pad, v_pad);
        end loop;
        v_code := v_code || format(E'%s    return null;\n%send if;\n', v_pad, v_pad);
    end loop;
    return v_code;
end
$$;

-- pgque._event_writer_max_tables(): how many event tables the writer holds
-- at most, whole queues only.
create or replace function pgque._event_writer_max_tables()
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 512 $$;

-- pgque._event_writer_queues(): the queues the writer holds now, ascending
-- by id (as this transaction sees them), with their table counts, and the
-- writer's signature (generator.sql): a digest of both.
create or replace function pgque._event_writer_queues(
    out queue_ids integer[], out table_counts integer[], out signature text)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select array_agg(q.queue_id order by q.queue_id),
           array_agg(q.queue_ntables order by q.queue_id),
           pgque._signature(coalesce(string_agg(q.queue_id || ':' || q.queue_ntables, ','
                                                order by q.queue_id), ''))
      from (select t.queue_id, t.queue_ntables,
                   sum(t.queue_ntables) over (order by t.queue_id) as tables
              from pgque.queue t) q
     where q.tables <= pgque._event_writer_max_tables()
$$;

-- pgque._event_writer_signature(): the signature of the writer wanted now.
create or replace function pgque._event_writer_signature()
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select w.signature from pgque._event_writer_queues() w
$$;

-- pgque._event_writer_source(): the body of pgque._write_event for the
-- queues _event_writer_queues gives.
create or replace function pgque._event_writer_source()
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select format(E'-- For %s queues.\n'
                  'declare\n'
                  '    v_id bigint;\n'
                  'begin\n'
                  '%s'
                  '    return null;  -- an unknown queue: the caller inserts dynamically\n'
                  'end\n',
                  coalesce(cardinality(w.queue_ids), 0),
                  pgque._event_writer_branches(w.queue_ids, w.table_counts, 1))
      from pgque._event_writer_queues() w
$$;

-- pgque._event_writer_due(): whether pgque._write_event is missing or was
-- written for other queues than those there are now (maintenance asks every
-- pass: read-only, no source built).
create or replace function pgque._event_writer_due()
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._generated_due('_write_event', pgque._event_writer_signature())
$$;

-- pgque._sync_event_writer(wait): writes pgque._write_event(queue_id, table,
-- type, data, key, id) for the queues there are now unless it is up to date
-- or, without wait, another transaction holds the writer's lock (see the top
-- of this file); returns 1 if it wrote it, else 0. The writer inserts one
-- event into event table `table` of queue `queue_id`, with id as its ev_id
-- (null: the next of the queue's sequence), and returns its ev_id, or returns
-- null for a queue or table it does not hold. Executable by no
-- one but the owner, like the writer.
create or replace function pgque._sync_event_writer(p_wait boolean)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_signature text;
begin
    if not pgque._event_writer_due() then
        return 0;
    end if;
    if not pgque._lock_generators(p_wait) then
        return 0;
    end if;
    -- Due again: a writer that committed while this one looked wrote it.
    v_signature := pgque._event_writer_signature();
    if not pgque._generated_due('_write_event', v_signature) then
        return 0;
    end if;
    perform pgque._write_generated(
        '_write_event',
        'p_queue_id integer, p_table integer, p_type text, p_data text, p_key text, p_id bigint',
        'returns bigint language plpgsql set search_path = pg_catalog, pg_temp',
        v_signature, pgque._event_writer_source());
    return 1;
end
$$;

-- ===== code/generated/generator.sql =====
-- pgque: generated code, the one protocol every generator follows.
--
-- A queue's event tables are named after its id, so a statement over them
-- written in a function would be dynamic SQL, parsed and planned on every call.
-- Where that costs more than the work (a send, a batch read), pgque writes
-- functions that hold those statements as static SQL, from its own tables:
--   the event writer   pgque._write_event, one for every queue (event_writer.sql)
--   batch readers      pgque._batch_reader_<queue id>, one per queue (batch_reader.sql)
-- The slot indexes (slot_index.sql) are generated too, as indexes rather than
-- code, by their own maintenance step beside these.
--
-- Every generated function follows the same steps:
--   signature  a digest of what it is written from (and of pgque's version),
--              recorded in the first line of its source;
--   due        missing, or its recorded signature differs from the one wanted
--              now (_generated_due): cheap, no source built;
--   lock       one lock for every generator (_lock_generators), held to the
--              writer's commit: two concurrent CREATE OR REPLACE (or DROP) of
--              one function fail with "tuple concurrently updated". Only the
--              install waits for it; anyone else who finds it taken leaves
--              the writing to the next maintenance pass, since a wait there,
--              in a transaction that may hold queue locks, could close a cycle;
--   write      CREATE OR REPLACE, then execution revoked from PUBLIC: callable
--              by pgque's own functions only (_write_generated).
-- Each is written when what it is made from changes (create_queue and
-- drop_queue, when the lock is free), by maintenance whenever due, and by
-- every install, which takes the lock first, drops it with the rest of the
-- code and writes it again (install/generated.sql). Maintenance goes on
-- meanwhile, its other steps need no such lock. Between those, a generated
-- function may lag:
-- it then answers null for what it does not know and its caller runs the same
-- statement dynamically, slower but never wrong. pgque.generated_code (and
-- `pgque status`) shows each one, and whether it lags.


-- pgque._lock_generators(wait): takes the lock of every generator, waiting
-- for it when wait, else only if it is free; returns whether this transaction
-- holds it now. The lock: pgque.install_lock in SHARE UPDATE EXCLUSIVE mode,
-- which conflicts with itself and with nothing else taken on that table (the
-- row locks installs, create_queue and drop_queue take do not conflict).
create or replace function pgque._lock_generators(p_wait boolean)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_wait then
        lock table pgque.install_lock in share update exclusive mode;
    else
        lock table pgque.install_lock in share update exclusive mode nowait;
    end if;
    return true;
exception when lock_not_available then
    return false;  -- another writer's, not committed yet: the next pass writes
end
$$;

-- pgque._generated_header(): how the source of every generated function
-- starts, its signature (32 hexadecimal digits, _signature) right after.
create or replace function pgque._generated_header()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select E'\n-- Generated by pgque (signature ' $$;

-- pgque._source_signature(source): the signature a generated function's
-- source records, or null for any other source. Reads the start of source
-- only (substr detoasts no more of it), as plain text: a regular expression
-- cost 16 µs a function, at every maintenance pass over every queue.
create or replace function pgque._source_signature(p_source text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when substr(p_source, 1, length(pgque._generated_header()))
                     = pgque._generated_header()
                then substr(p_source, length(pgque._generated_header()) + 1, 32) end
$$;

-- pgque._generated_signature(name): the signature recorded in the source of
-- the generated function pgque.<name>, or null when there is no such function.
create or replace function pgque._generated_signature(p_name text)
returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    -- PL/pgSQL for its cached plan (maintenance asks at every pass).
    return (select pgque._source_signature(p.prosrc)
              from pg_proc p
             where p.pronamespace = 'pgque'::regnamespace and p.proname = p_name);
end
$$;

-- pgque._generated_due(name, signature): whether the generated function
-- pgque.<name> is missing or was written for another signature.
create or replace function pgque._generated_due(p_name text, p_signature text)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._generated_signature(p_name) is distinct from p_signature
$$;

-- pgque._signature(inputs): the signature of generated code written from
-- inputs (a text that spells everything it depends on) by this pgque.
create or replace function pgque._signature(p_inputs text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select md5('0.13.0/' || p_inputs)
$$;

-- pgque._write_generated(name, arguments, definition, signature, body): writes
-- the PL/pgSQL function pgque.<name>(arguments) with definition (its return
-- type and attributes, as "returns ... language ...") and body, whose source
-- records signature; executable by the owner only. The caller holds the
-- function's lock (see the top of this file). name, arguments and definition
-- are pgque's own text, never a caller's.
create or replace function pgque._write_generated(
    p_name text, p_arguments text, p_definition text, p_signature text, p_body text)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    execute format('create or replace function pgque.%I(%s) %s as %L',
                   p_name, p_arguments, p_definition,
                   format(E'%s%s): not to be edited.\n%s',
                          pgque._generated_header(), p_signature, p_body));
    execute format('revoke all on function pgque.%I(%s) from public', p_name, p_arguments);
end
$$;

-- pgque._drop_generated(name): drops the generated function pgque.<name>
-- (every function of that name), if there is one.
create or replace function pgque._drop_generated(p_name text)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_function regprocedure;
begin
    for v_function in select p.oid from pg_proc p
                       where p.pronamespace = 'pgque'::regnamespace and p.proname = p_name loop
        -- cascade, as for a queue's tables: nothing may keep a queue from going.
        execute format('drop function %s cascade', v_function);
    end loop;
end
$$;

-- pgque._generated_code(): every piece of generated code there should be,
-- with whether it is current: the event writer, each queue's batch reader, and
-- each queue's slot indexes (current when every event table has exactly the
-- indexes its groups need; a table too big to index while producers write
-- gets them when maintenance next empties it, and lags until then); and the
-- reader of a dropped queue that is still there (never current: maintenance
-- drops it).
create or replace function pgque._generated_code(
    out kind text, out queue_id integer, out name text, out current boolean)
returns setof record
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select 'event writer', null::integer, '_write_event',
           not pgque._generated_due('_write_event', pgque._event_writer_signature())
    union all
    select 'batch reader', q.queue_id, pgque._batch_reader_name(q.queue_id),
           not pgque._generated_due(pgque._batch_reader_name(q.queue_id),
                                    pgque._batch_reader_signature(q.queue_id))
      from pgque.queue q
    union all
    select 'batch reader', null, o.name, false from pgque._orphan_readers() o(name)
    union all
    select 'slot indexes', q.queue_id, pgque._event_table(q.queue_id) || '_slots*',
           not pgque._slot_indexes_lag(q.queue_id)
      from pgque.queue q
$$;

-- ===== code/generated/slot_index.sql =====
-- pgque: slot indexes, so that a slot reads only its own events.
--
-- A slot's batch is the queue's batch filtered by the routing formula
-- (pgque.slot_of). Without help, every slot of a group of N reads the whole
-- batch to keep one event in N. So each event table gets, for every slot
-- count N > 1 that a group of the queue uses, an index on
-- (the routing formula with N written out, ev_txid): a slot's read then
-- fetches only the rows of its hash class. The index is an access path and
-- nothing more: a table without it gives the same events, read the slower way.
--
-- Maintenance keeps the indexes in line with the groups (pgque.maint), each
-- pass in its own short transaction: subscribe and unsubscribe touch no
-- event table, so neither makes producers wait, in whatever transaction they
-- run. A pass builds an index only on a table it can lock within 50 ms and
-- that is small (_slot_index_build_limit), so that the build holds producers
-- for milliseconds; a busy or large table gets its index when maintenance
-- truncates it, empty.
--
-- The formula must match, character for character, the filter that
-- _batch_where writes, or the planner will not use the index: both take it
-- from pgque._slot_expr (consumers/read.sql).


-- pgque._slot_index_name(queue_id, n, slots): the name of event table n's
-- index for groups of slots slots. Built from integers only.
create or replace function pgque._slot_index_name(p_queue_id integer, p_n integer,
                                                  p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._event_table(p_queue_id, p_n) || '_slots' || p_slots::text
$$;

-- pgque._slot_index_build_limit(): the largest event table (in bytes, its
-- heap on disk) that maintenance builds a slot index on while producers may
-- be waiting: about 10,000 events of a few hundred bytes, a few milliseconds.
create or replace function pgque._slot_index_build_limit()
returns bigint
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 4 * 1024 * 1024::bigint $$;

-- pgque._slot_counts_wanted(queue_id): the slot counts above 1 that the
-- queue's consumer groups use, ascending: those its event tables need an
-- index for.
create or replace function pgque._slot_counts_wanted(p_queue_id integer)
returns integer[]
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(array_agg(distinct g.cg_slots order by g.cg_slots), '{}')
      from pgque.consumer_group g
     where g.cg_queue = p_queue_id and g.cg_slots > 1
$$;

-- pgque._slot_indexes_on(queue_id, n): the slot counts that event table n of
-- the queue has a slot index for (by the index names _slot_index_name gives).
-- PL/pgSQL for its cached plan: maintenance asks at every pass, for every
-- table (as SQL with a SET clause it was planned at each call, 95 µs).
create or replace function pgque._slot_indexes_on(p_queue_id integer, p_n integer)
returns integer[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_table text := pgque._event_table(p_queue_id, p_n);
    -- to_regclass: a table that drop_queue dropped meanwhile has no index (the
    -- info views read queues their statement's snapshot still shows).
    v_oid oid := to_regclass(format('pgque.%I', v_table));
    v_have integer[];
begin
    if v_oid is null then
        return '{}';
    end if;
    select coalesce(array_agg(substring(c.relname from '_slots([0-9]+)$')::integer), '{}')
      into v_have
      from pg_index i join pg_class c on c.oid = i.indexrelid
     where i.indrelid = v_oid
       and c.relname ~ ('^' || v_table || '_slots[0-9]+$');
    return v_have;
end
$$;

-- pgque._slot_index_buildable(queue_id, n): whether event table n of the
-- queue is small enough for an index build while producers may wait
-- (_slot_index_build_limit).
create or replace function pgque._slot_index_buildable(p_queue_id integer, p_n integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_relation_size(format('pgque.%I', pgque._event_table(p_queue_id, p_n))::regclass)
           <= pgque._slot_index_build_limit()
$$;

-- pgque._sync_slot_indexes(queue_id, n, busy_wait): makes event table n of the
-- queue (null: every event table) have exactly one slot index per slot count
-- above 1 that a consumer group of the queue uses: creates the missing ones
-- and drops those no group needs. busy_wait bounds the wait for a table's
-- lock (a lock_timeout value such as '50ms'); a table still busy then is left
-- as it is and gets its indexes when maintenance next truncates it. Null
-- waits as long as it takes (for a caller that holds the table's lock).
-- A caller that does not hold the lock (busy_wait given) builds no index on
-- a table larger than _slot_index_build_limit() either: the build would hold
-- the table's producers for as long as it takes; that table, too, gets its
-- index at its next truncate. Returns how many indexes were created or
-- dropped.
--
-- The caller holds the queue's maintenance lock (pgque._lock_queue), so two
-- syncs of one queue never race to create the same index, and a truncate
-- never runs in the middle of one.
create or replace function pgque._sync_slot_indexes(p_queue_id integer, p_n integer,
                                                    p_busy_wait text)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_wanted integer[] := pgque._slot_counts_wanted(p_queue_id);
    v_lock_timeout text := current_setting('lock_timeout');
    v_ntables integer;
    v_table text;
    v_have integer[];
    v_build integer[];
    v_slots integer;
    v_changed integer := 0;
    v_here integer;
    n integer;
begin
    select q.queue_ntables into v_ntables from pgque.queue q where q.queue_id = p_queue_id;
    if not found then
        return 0;  -- dropped meanwhile
    end if;
    for n in 0 .. v_ntables - 1 loop
        continue when p_n is not null and n <> p_n;
        v_table := pgque._event_table(p_queue_id, n);
        v_have := pgque._slot_indexes_on(p_queue_id, n);
        continue when v_have @> v_wanted and v_wanted @> v_have;
        v_here := 0;
        v_build := v_wanted;
        if p_busy_wait is not null and not pgque._slot_index_buildable(p_queue_id, n) then
            v_build := '{}';  -- too big to index now: only drop, on this table
        end if;
        begin
            if p_busy_wait is not null then
                perform set_config('lock_timeout', p_busy_wait, true);
            end if;
            foreach v_slots in array v_build loop
                continue when v_slots = any(v_have);
                execute format('create index %I on pgque.%I (%s, ev_txid)',
                               pgque._slot_index_name(p_queue_id, n, v_slots), v_table,
                               pgque._slot_expr(v_slots));
                v_here := v_here + 1;
            end loop;
            foreach v_slots in array v_have loop
                continue when v_slots = any(v_wanted);
                execute format('drop index pgque.%I', pgque._slot_index_name(p_queue_id, n, v_slots));
                v_here := v_here + 1;
            end loop;
            perform set_config('lock_timeout', v_lock_timeout, true);
            v_changed := v_changed + v_here;
        exception when lock_not_available then
            -- Busy (a long insert into the current table, say): this table's
            -- slots read the slower way until its next truncate.
            perform set_config('lock_timeout', v_lock_timeout, true);
        end;
    end loop;
    return v_changed;
end
$$;

-- pgque._slot_indexes_due(queue_id): whether _sync_slot_indexes would change
-- anything now, without locking: an index no group needs, or one missing on a
-- table small enough to build it on. Read-only (for _maint_due).
create or replace function pgque._slot_indexes_due(p_queue_id integer)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_wanted integer[] := pgque._slot_counts_wanted(p_queue_id);
    v_have integer[];
    n integer;
begin
    for n in 0 .. coalesce((select q.queue_ntables from pgque.queue q
                             where q.queue_id = p_queue_id), 0) - 1 loop
        v_have := pgque._slot_indexes_on(p_queue_id, n);
        if not v_have <@ v_wanted
           or (not v_wanted <@ v_have and pgque._slot_index_buildable(p_queue_id, n)) then
            return true;
        end if;
    end loop;
    return false;
end
$$;

-- pgque._slot_indexes_lag(queue_id): whether an event table of the queue
-- lacks a slot index its groups need or has one none needs, buildable now or
-- not (for pgque.generated_code).
create or replace function pgque._slot_indexes_lag(p_queue_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.queue q
                    cross join generate_series(0, q.queue_ntables - 1) n
                    cross join lateral pgque._slot_indexes_on(q.queue_id, n) h(have)
                    where q.queue_id = p_queue_id
                      and not (h.have @> pgque._slot_counts_wanted(q.queue_id)
                               and h.have <@ pgque._slot_counts_wanted(q.queue_id)))
$$;

-- ===== code/ticker/cron.sql =====
-- pgque: ticking from inside the database with pg_cron.
--
-- An alternative to running a pgque.Ticker (or Workers, which run one) when
-- the pg_cron extension is installed in this database (cron.database_name
-- names it). pg_cron schedules by the minute in most versions, so its job
-- runs pgque.ticker_loop(), which ticks every 100 ms for just under a minute
-- and is started again by the next run. The loop runs in the same election
-- as the Python Ticker (pgque.claim_ticker), so only one of them ticks a
-- database at a time.

-- pgque.ticker_loop(seconds, interval_ms): for about seconds seconds, every
-- interval_ms milliseconds, ticks every queue that has pending events
-- (pgque.ticker()), committing each time, and runs maintenance every second.
-- Returns at once when another ticker holds the election lock.
--
-- A procedure that commits may be neither SECURITY DEFINER nor pin its
-- search_path (PostgreSQL refuses the COMMIT), and it runs with its caller's
-- path: pg_cron's job runs it as the installer with whatever path the job
-- has. So nothing in it is looked up on that path: every function and
-- operator is schema-qualified, and every type is spelled with its SQL
-- keyword (timestamp with time zone, not timestamptz, which a role could
-- shadow with a type of its own in public). Grant EXECUTE to admins only.
create or replace procedure pgque.ticker_loop(
    p_seconds double precision default 58, p_interval_ms integer default 100)
language plpgsql
as $$
declare
    v_until timestamp with time zone := pg_catalog.clock_timestamp()
        operator(pg_catalog.+) pg_catalog.make_interval(secs => p_seconds);
    v_next_maint timestamp with time zone := pg_catalog.clock_timestamp();
    v_after integer;
begin
    if not pgque.claim_ticker() then
        return;
    end if;
    -- A Python Ticker that went away asleep left the queues marked: this loop
    -- never sleeps, so sends must stop notifying (ticker/sleep.sql).
    perform pgque.ticker_wake();
    commit;
    while pg_catalog.clock_timestamp() operator(pg_catalog.<) v_until loop
        -- A few hundred queues a transaction (pgque.ticker_some): one over
        -- thousands would outgrow the lock table.
        v_after := null;
        loop
            select s.last_queue into v_after from pgque.ticker_some(v_after, 500) s;
            exit when v_after is null;
            commit;
        end loop;
        if pg_catalog.clock_timestamp() operator(pg_catalog.>=) v_next_maint then
            perform pgque.maint();
            v_next_maint := pg_catalog.clock_timestamp()
                operator(pg_catalog.+) interval '1 second';
        end if;
        commit;
        perform pg_catalog.pg_sleep(p_interval_ms operator(pg_catalog./) 1000.0);
    end loop;
    perform pgque.release_ticker();
end
$$;

-- pgque.start_cron(): schedules pgque.ticker_loop() every minute with
-- pg_cron (job 'pgque-ticker'), replacing an earlier schedule of that name;
-- returns the job id. Raises PQ030 when pg_cron is not installed here.
create or replace function pgque.start_cron()
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_job bigint;
begin
    if not exists (select 1 from pg_catalog.pg_extension where extname = 'pg_cron') then
        raise exception using errcode = 'PQ030',
            message = 'pg_cron is not installed in this database',
            hint = 'Add pg_cron to shared_preload_libraries, set cron.database_name to this '
                   'database and CREATE EXTENSION pg_cron; or run pgque.Ticker / workers instead.';
    end if;
    execute 'select cron.schedule($1, $2, $3)'
       into v_job
      using 'pgque-ticker', '* * * * *', 'call pgque.ticker_loop()';
    return v_job;
end
$$;

-- pgque.stop_cron(): removes the 'pgque-ticker' job; true when there was one.
-- A loop already running finishes its minute. Raises PQ030 without pg_cron.
create or replace function pgque.stop_cron()
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_found boolean;
begin
    if not exists (select 1 from pg_catalog.pg_extension where extname = 'pg_cron') then
        raise exception using errcode = 'PQ030',
            message = 'pg_cron is not installed in this database';
    end if;
    execute 'select exists (select 1 from cron.job where jobname = $1)' into v_found
      using 'pgque-ticker';
    if v_found then
        execute 'select cron.unschedule($1)' using 'pgque-ticker';
    end if;
    return v_found;
end
$$;

-- ===== code/ticker/election.sql =====
-- pgque: the ticker election.
--
-- Any number of tickers (pgque.Ticker, every Worker's, pg_cron's
-- ticker_loop) may run against a database; the active one holds a session
-- advisory lock on the install's random election key (pgque.ticker_election)
-- and the others stand by. The key is not published, but pg_locks shows it
-- while it is held, and advisory locks need no privilege: a role that may not
-- tick could wait on it and get it when the active ticker goes. So only
-- sessions of roles that may run claim_ticker count, and a claim that finds
-- the key held or awaited by no such session, only by others, renews it.
-- (The standbys' tick_overdue keeps delivery going meanwhile in any case.)


-- pgque._ticker_key(): the current election key.
create or replace function pgque._ticker_key()
returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select te_key from pgque.ticker_election $$;

-- pgque._may_tick(role): whether sessions of role (an oid: a login role, as
-- pg_stat_activity shows it) count in the election: those whose role, or a
-- role they are members of, may run claim_ticker (admins, or roles granted it).
create or replace function pgque._may_tick(p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select pgque._may_execute(p_role, to_regprocedure('pgque.claim_ticker()')) $$;

-- pgque.claim_ticker(): tries, without waiting, to become the active ticker
-- of the database; true when this session holds the election lock (also
-- when it already did). Renews the key first when only sessions that may not
-- tick hold or await it.
create or replace function pgque.claim_ticker()
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if not pgque._may_tick(pgque._session_role()) then
        raise exception using errcode = '42501',
            message = format('sessions of login role %s do not count in the ticker election',
                             pgque._session_role()::regrole),
            hint = 'The election judges sessions by their login role: grant the login role '
                   '(or a role it is a member of) pgque_admin.';
    end if;
    return pgque._holds_key(pgque._ticker_key())
        or pgque._take_key('ticker', null);
end
$$;

-- pgque.release_ticker(): gives up the election if this session holds it;
-- true when it did.
create or replace function pgque.release_ticker()
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._unlock_key(pgque._ticker_key()) $$;

-- pgque.active_ticker(): the backend pid of the active ticker, or null. Only
-- sessions that may tick count.
create or replace function pgque.active_ticker()
returns integer
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select k.pid from pgque._key_sessions(pgque._ticker_key()) k
     where k.granted and k.mode = 'ExclusiveLock' and pgque._may_tick(k.role)
     limit 1
$$;

-- ===== code/ticker/maint.sql =====
-- pgque: maintenance (event table rotation, retry re-insertion; the rotation
-- of the cursor log, the ticks, the nack records and the retry queue is in
-- rotation.sql).
--
-- Each step is safe to run concurrently and repeatedly: steps of one queue
-- are serialized by the queue's maintenance lock, its 'maint' row of
-- pgque.queue_lock taken FOR UPDATE, and a second caller skips the queue
-- without waiting. Taking the row assigns a transaction id and writes WAL,
-- so maint() first looks, without it, whether any step has work
-- (_maint_due): maintenance of an idle queue, run every second, writes
-- nothing.

-- pgque._consumed_floor(queue_id): a transaction id below which every event
-- of the queue has been consumed by every subscription: the lowest xmin of the
-- subscriptions' last finished ticks (with no subscription, of the newest
-- tick). Null when unknown.
create or replace function pgque._consumed_floor(p_queue_id integer)
returns xid8
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when exists (select 1 from pgque.subscription where sub_queue = p_queue_id)
           then (select min(pg_snapshot_xmin(t.tick_snapshot))
                   from pgque.subscription s
                   cross join lateral pgque._current_cursor(s.sub_id) c
                   join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick
                  where s.sub_queue = p_queue_id)
           else pg_snapshot_xmin((pgque._last_tick(p_queue_id)).tick_snapshot)
           end
$$;

-- pgque._maint_rotate(queue): truncates every event table other than the
-- current one whose events all subscriptions have consumed, then switches
-- the current table when rotation_period has passed and the next table is
-- empty. Returns the number of tables truncated plus one if it switched.
-- Records in queue_used_tables the tables other than the current one that
-- may still hold events: those it did not find empty or empty them, and the
-- one it switched away from (see _maint_look).
--
-- A producer that read the old current table just before a switch may still
-- be inserting into it. The table is therefore locked before it is judged:
-- the lock waits for such writers to finish, and only then is its newest
-- ev_txid compared with the consumed floor. The lock wait is bounded so a
-- long transaction stalls rotation, never consumers.
create or replace function pgque._maint_rotate(p_queue pgque.queue)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_floor xid8 := pgque._consumed_floor(p_queue.queue_id);
    v_lock_timeout text := current_setting('lock_timeout');
    v_table text;
    v_nonempty boolean;
    v_max xid8;
    v_done integer := 0;
    v_used bigint := 0;
    n integer;
begin
    for n in 0 .. p_queue.queue_ntables - 1 loop
        continue when n = p_queue.queue_cur_table;
        v_table := pgque._event_table(p_queue.queue_id, n);
        execute format('select exists (select 1 from pgque.%I)', v_table) into v_nonempty;
        if not v_nonempty and p_queue.queue_used_tables & (1::bigint << n) <> 0 then
            -- Unmarked only if no insert is in flight (a producer that read
            -- the queue row before the switch, its transaction still open):
            -- a SHARE lock, without waiting, then the look again.
            begin
                execute format('lock table pgque.%I in share mode nowait', v_table);
                execute format('select exists (select 1 from pgque.%I)', v_table) into v_nonempty;
            exception when lock_not_available then
                v_nonempty := true;
            end;
        end if;
        continue when not v_nonempty;
        v_used := v_used | (1::bigint << n);  -- unless emptied below
        continue when v_floor is null;
        begin
            perform set_config('lock_timeout', '50ms', true);
            execute format('lock table pgque.%I in access exclusive mode', v_table);
            perform set_config('lock_timeout', v_lock_timeout, true);
            execute format('select max(ev_txid) from pgque.%I', v_table) into v_max;
            if v_max is null or v_max < v_floor then
                execute format('truncate pgque.%I', v_table);
                -- Empty and locked: the cheapest moment to bring its slot
                -- indexes in line with the queue's groups.
                perform pgque._sync_slot_indexes(p_queue.queue_id, n, null);
                v_done := v_done + 1;
                v_used := v_used & ~(1::bigint << n);
            end if;
        exception when lock_not_available then
            null;  -- busy: try again at the next maintenance pass
        end;
    end loop;

    if now() - p_queue.queue_switch_time >= p_queue.queue_rotation_period then
        n := (p_queue.queue_cur_table + 1) % p_queue.queue_ntables;
        execute format('select exists (select 1 from pgque.%I)',
                       pgque._event_table(p_queue.queue_id, n))
           into v_nonempty;
        if not v_nonempty then
            update pgque.queue
               set queue_cur_table = n, queue_switch_time = now(),
                   queue_used_tables = (v_used | (1::bigint << p_queue.queue_cur_table))
                                       & ~(1::bigint << n)
             where queue_id = p_queue.queue_id;
            return v_done + 1;
        end if;
    end if;
    if v_used <> p_queue.queue_used_tables then
        update pgque.queue set queue_used_tables = v_used where queue_id = p_queue.queue_id;
    end if;
    return v_done;
end
$$;

-- pgque._ticks_kept_from(queue_id): the oldest tick of the queue that a
-- subscription may still need: the oldest last finished tick of its
-- subscriptions; with no subscription, its newest tick.
create or replace function pgque._ticks_kept_from(p_queue_id integer)
returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce((select min(c.cur_last_tick)
                       from pgque.subscription s cross join lateral pgque._current_cursor(s.sub_id) c
                      where s.sub_queue = p_queue_id),
                    (pgque._last_tick(p_queue_id)).tick_id)
$$;

-- pgque._maint_due(queue): whether any maintenance step has work for the
-- queue, looked at without its maintenance lock and without writing: a
-- table to truncate (a non-current event table, not empty, whose newest
-- event is below the consumed floor) or to switch to (rotation_period passed
-- and the next table is empty), a due retry, a slot index to make or drop
-- (_slot_indexes_due), a batch reader to write again (_batch_reader_due), a
-- table found empty that queue_used_tables still marks.
-- Each test is the one its step applies, so it never says no while a step
-- would act.
-- (Rows of a transaction still in progress are not seen; they would not be
-- seen by the step either, and an in-progress transaction's id is never
-- below the consumed floor.) It must neither wait nor fail: locks are waited
-- for at most 1 ms (a drop_queue holds the queue's tables until it commits,
-- a running truncate holds one), and when it cannot tell it says yes, and
-- the steps decide under the lock.
create or replace function pgque._maint_due(p_queue pgque.queue)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
declare
    v_floor xid8;
    v_max xid8;
    v_nonempty boolean;
    n integer;
begin
    begin
        if exists (select 1 from pgque._retry_waiting r
                    where r.ev_queue = p_queue.queue_id and r.ev_retry_after <= now()) then
            return true;
        end if;
        if pgque._slot_indexes_due(p_queue.queue_id) or pgque._batch_reader_due(p_queue.queue_id) then
            return true;
        end if;
        if now() - p_queue.queue_switch_time >= p_queue.queue_rotation_period then
            execute format('select exists (select 1 from pgque.%I)',
                           pgque._event_table(p_queue.queue_id,
                                              (p_queue.queue_cur_table + 1) % p_queue.queue_ntables))
               into v_nonempty;
            if not v_nonempty then
                return true;
            end if;
        end if;
        v_floor := pgque._consumed_floor(p_queue.queue_id);
        for n in 0 .. p_queue.queue_ntables - 1 loop
            continue when n = p_queue.queue_cur_table
                          or (v_floor is null and p_queue.queue_used_tables & (1::bigint << n) = 0);
            execute format('select max(ev_txid) from pgque.%I', pgque._event_table(p_queue.queue_id, n))
               into v_max;
            -- A table to truncate, or one found empty that is still marked in use.
            if v_max < v_floor
               or (v_max is null and p_queue.queue_used_tables & (1::bigint << n) <> 0) then
                return true;
            end if;
        end loop;
        return false;
    exception when others then
        null;  -- (a lock timeout left pending is raised here: see _seq_before)
    end;
    return true;
exception when lock_not_available then
    return true;
end
$$;

-- pgque._maint_look(): the queues a pass over all of them looks at closely
-- (_maint_due, then the steps), in one statement over every queue: a superset
-- of those where _maint_due says yes, from the queue rows and the catalog
-- only, never an event table: rotation_period passed (a switch may be due),
-- a table besides the current one marked in use (queue_used_tables: to
-- truncate once consumed), a retry due, a batch reader written for other slot
-- counts than the groups use (_batch_reader_due), or, for a queue with
-- groups of slots, an event table whose slot indexes are not those counts
-- (_slot_indexes_due). A slot index that no group needs any more on a queue
-- without groups is dropped when the groups change (the reader is written
-- again then) or, when its table was busy then, at the table's next
-- truncate. Reads only.
create or replace function pgque._maint_look()
returns setof integer
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select q.queue_id
      from pgque.queue q
     cross join lateral (select coalesce(array_agg(distinct g.cg_slots order by g.cg_slots), '{}')
                                as counts
                           from pgque.consumer_group g
                          where g.cg_queue = q.queue_id and g.cg_slots > 1) w
     where now() - q.queue_switch_time >= q.queue_rotation_period
        or q.queue_used_tables & ~(1::bigint << q.queue_cur_table) <> 0
        or exists (select from pgque._retry_waiting r
                    where r.ev_queue = q.queue_id and r.ev_retry_after <= now())
        -- _batch_reader_due, written out: as _generated_signature reads it
        or (select pgque._source_signature(p.prosrc)
              from pg_proc p
             where p.pronamespace = 'pgque'::regnamespace
               and p.proname = '_batch_reader_' || q.queue_id)
           is distinct from pgque._signature(q.queue_id || ':' || w.counts::text)
        -- _slot_indexes_on, written out, for every table of a queue with groups
        or (w.counts <> '{}'
            and exists (select from generate_series(0, q.queue_ntables - 1) n
                         cross join lateral (select 'event_' || q.queue_id || '_' || n as name) t
                         where (select coalesce(array_agg(split_part(ic.relname, '_slots', 2)::integer
                                                          order by 1), '{}')
                                  from pg_class tc
                                  join pg_index i on i.indrelid = tc.oid
                                  join pg_class ic on ic.oid = i.indexrelid
                                 where tc.relnamespace = 'pgque'::regnamespace
                                   and tc.relname = t.name
                                   and ic.relname like t.name || '\_slots%')
                               is distinct from w.counts))
     order by q.queue_id
$$;

-- pgque.maint(queue): runs every maintenance step for one queue (all queues
-- when null) and reports what it did as rows (queue_name, step, amount).
-- A queue whose maintenance is already running elsewhere (or that is being
-- dropped) is skipped, and so, without taking any lock, is a queue where no
-- step has work (_maint_due); a pass over all queues asks that only of the
-- queues _maint_look names. Every call then rotates the cursor log, the
-- ticks, the nack records, the retry queue, the held events, the delayed
-- events and the idempotency keys of all queues when they are due (steps
-- rotate_cursors, rotate_ticks, rotate_nacks, rotate_retries, rotate_held,
-- rotate_delayed and rotate_idempotency, queue_name null). A pass over all
-- queues also writes the event writer when it is due (step event_writer,
-- queue_name null). PQ008 outside READ COMMITTED, as for a tick.
create or replace function pgque.maint(p_queue text default null)
returns table (queue_name text, step text, amount bigint)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
#variable_conflict use_column
declare
    v_id integer;
    v_queue pgque.queue;
    v_amount bigint;
begin
    -- Its rotations copy what is still needed and then TRUNCATE: a snapshot
    -- older than the statement would copy less than was committed.
    if current_setting('transaction_isolation') <> 'read committed' then
        raise exception using errcode = 'PQ008',
            message = 'pgque maintenance must run in a READ COMMITTED transaction';
    end if;
    if p_queue is not null then
        perform pgque._queue_row(p_queue);
    end if;
    -- A pass over all queues looks closely only at those _maint_look names.
    for v_id in select q.queue_id from pgque.queue q
                 where q.queue_name = p_queue
                union all
                select l from pgque._maint_look() l
                 where p_queue is null
                 order by 1 loop
        -- The look without the lock, on the queue row as it is now (another
        -- maint may have rotated it since the loop began).
        select * into v_queue from pgque.queue q where q.queue_id = v_id;
        continue when not found;
        continue when not pgque._maint_due(v_queue);
        continue when not pgque._lock_queue(v_id, 'maint', false);
        -- Read again under the lock: drop_queue takes it too, so a queue
        -- dropped since the loop began is gone now and must not be touched.
        select * into v_queue from pgque.queue q where q.queue_id = v_id;
        continue when not found;
        -- The steps that judge what no subscription needs any more read every
        -- cursor: a statement whose snapshot a cursor rotation outran gets
        -- 40001 there (_current_cursor), and the step waits for the next pass.
        begin
            v_amount := pgque._maint_rotate(v_queue);
        exception when serialization_failure then
            v_amount := 0;
        end;
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'rotate'; amount := v_amount;
            return next;
            select * into v_queue from pgque.queue q where q.queue_id = v_queue.queue_id;
        end if;
        v_amount := pgque._maint_retry(v_queue);
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'retry'; amount := v_amount;
            return next;
        end if;
        v_amount := pgque._sync_slot_indexes(v_queue.queue_id, null, '50ms');
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'slot_indexes'; amount := v_amount;
            return next;
        end if;
        v_amount := pgque._sync_batch_reader(v_queue.queue_id, false);
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'batch_reader'; amount := v_amount;
            return next;
        end if;
    end loop;
    -- The event writer (generated/event_writer.sql) of every queue, and the
    -- readers of dropped queues, when a create_queue or drop_queue could not
    -- write or drop them: on passes over them all.
    if p_queue is null then
        v_amount := pgque._sync_event_writer(false);
        if v_amount > 0 then
            queue_name := null; step := 'event_writer'; amount := v_amount;
            return next;
        end if;
        v_amount := pgque._drop_orphan_readers(false);
        if v_amount > 0 then
            queue_name := null; step := 'batch_reader'; amount := v_amount;
            return next;
        end if;
    end if;
    -- The rotated tables of all queues (ticker/rotation.sql), when due: the
    -- partitions emptied, plus one for a switch (and for the cursor log, one
    -- for a move ended). Last, so that the locks they take are held only
    -- until the commit that follows.
    v_amount := pgque._rotate_cursors();
    if v_amount is not null then
        queue_name := null; step := 'rotate_cursors'; amount := v_amount;
        return next;
    end if;
    begin
        v_amount := pgque._rotate_ticks();
    exception when serialization_failure then
        v_amount := null;
    end;
    if v_amount is not null then
        queue_name := null; step := 'rotate_ticks'; amount := v_amount;
        return next;
    end if;
    begin
        v_amount := pgque._rotate_nacks();
    exception when serialization_failure then
        v_amount := null;
    end;
    if v_amount is not null then
        queue_name := null; step := 'rotate_nacks'; amount := v_amount;
        return next;
    end if;
    v_amount := pgque._rotate_retries();
    if v_amount is not null then
        queue_name := null; step := 'rotate_retries'; amount := v_amount;
        return next;
    end if;
    v_amount := pgque._rotate_held();
    if v_amount is not null then
        queue_name := null; step := 'rotate_held'; amount := v_amount;
        return next;
    end if;
    v_amount := pgque._rotate_delayed();
    if v_amount is not null then
        queue_name := null; step := 'rotate_delayed'; amount := v_amount;
        return next;
    end if;
    v_amount := pgque._rotate_idempotency();
    if v_amount is not null then
        queue_name := null; step := 'rotate_idempotency'; amount := v_amount;
        return next;
    end if;
end
$$;

-- ===== code/ticker/rotation.sql =====
-- pgque: the engine's own state in rotating tables, emptied by TRUNCATE.
--
-- The cursor log and the ticks are written all the time: a cursor row per
-- receive and per ack of every subscription, a tick row per tick; the nack
-- records and the retry queue at every nack. Rows that
-- maintenance DELETEd would be dead rows for vacuum, and a transaction that
-- holds the xmin horizon back (a long report, a session idle in transaction,
-- a lagging replication slot) would pile them up for as long as it lasts. So
-- each of these tables is partitioned in two (migration 7): one partition is
-- written (pgque.rotation's rt_part), and the other is emptied with TRUNCATE
-- once nothing in it is needed, which removes its file and leaves nothing
-- for vacuum. Every rt_period (a minute) that something was written,
-- maintenance switches the writes to the emptied one. The row of
-- pgque.rotation is the only row updated: once per switch. An idle database
-- rotates nothing.
--
-- The cursor log. A subscription's current cursor is its newest row in the
-- partition written now: one index probe. A switch sends the writes to the
-- other partition and copies over the current cursor of every subscription
-- whose receive lock is free; a subscription busy then is "not moved yet",
-- its cursor read in the partition left (a second probe), until its next
-- write or a later pass moves it. Once all have moved, the partition left
-- holds superseded rows only, and is emptied a period later. (A new
-- subscription, whose first cursor no switch would copy, holds the rotation
-- row FOR SHARE until it commits, and no switch comes meanwhile.)

-- The ticks. Ticks are found by queue and id in both partitions, and
-- nothing is copied: the partition not written is emptied once no queue
-- needs a tick in it (from the oldest last finished tick of its
-- subscriptions on, and its newest tick), as an event table is once every
-- consumer is past it. A lagging subscription holds it back, and the ticks
-- pile up in the partition written meanwhile, as events do.
--
-- The nack records: a batch's records all go to one partition, chosen by its
-- id against the last switch's boundary, and the partition of the batches
-- before that switch is emptied once none of them is open (_rotate_nacks).
-- The retry queue: a moved retry is marked by a row of pgque.retry_moved, not
-- deleted; the partition not written is emptied after its retries still
-- waiting are copied over (_rotate_retries).
--
-- Snapshots. TRUNCATE is not MVCC-safe: a statement whose snapshot is older
-- than the truncate and that takes its locks after it sees the partition
-- empty. A statement takes the locks of its own plan before its snapshot, but
-- a query inside a function it calls takes them later, under that snapshot.
-- That is why no rotation empties anything a current reader may need: a
-- truncated tick partition holds no tick any cursor names (a queue idle since
-- the switch gets a new tick instead, so that its consumers move on), and a
-- truncated cursor partition holds only rows superseded a whole period
-- before. A statement that still finds no cursor for a subscription gets
-- 40001 (_current_cursor); so does a REPEATABLE READ or SERIALIZABLE
-- transaction that would write a cursor after a switch its snapshot does not
-- see (_write_part), which would go to the partition left.


-- Locks. A rotation takes the rotation row FOR UPDATE NOWAIT, and the
-- partition it empties first without queueing for it, then queueing for at
-- most 25 ms (_lock_partition): a receive, an ack or a tick waits that long
-- at most, and the copy and the truncate, which come at the very end of
-- maint(), until its commit. A switch of the cursor log takes no lock a
-- receive or an ack holds: it copies the cursors of the subscriptions whose
-- receive locks are free (SKIP LOCKED), and the others move at their next
-- write or at a later pass. Whatever it cannot have, it leaves to the next
-- maintenance pass.

-- pgque._cursor_parts(): where the current cursors are, as of this
-- statement's snapshot: the partition written now (part), and while a switch
-- is moving the subscriptions over (_rotate_cursors), the partition left
-- (moved_from, else null), where a subscription that has not moved yet has
-- its newest row.
create or replace function pgque._cursor_parts(out part smallint, out moved_from smallint)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    -- PL/pgSQL, not SQL: a SQL function with a pinned search_path is planned
    -- again in every transaction (docs/design-notes.md), and this one is on
    -- every receive's path.
    select r.rt_part, case when r.rt_moving then (r.rt_part + 1) % r.rt_parts end
      into part, moved_from
      from pgque.rotation r where r.rt_name = 'cursor';
end
$$;

-- pgque._write_part(name, share): the partition of rotated table name to
-- write a row into, as of now. A transaction whose snapshot is older than
-- the statement (REPEATABLE READ, SERIALIZABLE) may see the partition a
-- switch has left. For the cursor log a write there would be lost: it gets
-- 40001 when the cursor log switched since its snapshot
-- (pgque.cursor_switch_seq, which a switch advances, is past the switch its
-- snapshot sees), without locking anything. (A retry written there is kept:
-- that partition is emptied only after its waiting retries are copied.) With share, the rotation row is locked FOR SHARE until the
-- transaction ends: for a writer that holds no receive lock (a new
-- subscription), so that no switch happens before it commits.
create or replace function pgque._write_part(p_name text, p_share boolean default false)
returns smallint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
begin
    if p_share then
        return (select r.rt_part from pgque.rotation r where r.rt_name = p_name for share);
    end if;
    select * into v_rotation from pgque.rotation r where r.rt_name = p_name;
    if p_name = 'cursor' and current_setting('transaction_isolation') <> 'read committed'
       and coalesce(pg_sequence_last_value('pgque.cursor_switch_seq'), 0)
           > v_rotation.rt_switch then
        raise exception using errcode = '40001',
            message = 'pgque rotated its cursor tables after this transaction''s snapshot',
            hint = 'Retry the transaction.';
    end if;
    return v_rotation.rt_part;
end
$$;

-- pgque._try_lock(statement, tries): runs statement, which takes locks with
-- NOWAIT, until it gets them, at most tries times, 5 ms apart; false when it
-- did not. Between tries it holds nothing, and it never queues: a session
-- that wants a lock it tries for never waits behind it.
create or replace function pgque._try_lock(p_statement text, p_tries integer)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    for i in 1 .. p_tries loop
        begin
            execute p_statement;
            return true;
        exception when lock_not_available then
            perform pg_sleep(0.005);  -- what it had taken is released with the block
        end;
    end loop;
    return false;
end
$$;

-- pgque._lock_rotation(name): the rotation row of name FOR UPDATE, without
-- waiting; null when another rotation or a writer holding it FOR SHARE has it,
-- else the partition written now.
create or replace function pgque._lock_rotation(p_name text)
returns smallint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select r.rt_part from pgque.rotation r where r.rt_name = p_name
               for update nowait);
exception when lock_not_available then
    return null;
end
$$;

-- pgque._switch_rotation(name, part, moving): makes part the partition of
-- name written from now on (the caller holds the row, _lock_rotation). The
-- switch's number: for the cursor log the next value of
-- pgque.cursor_switch_seq (_write_part), for the nack records the boundary
-- of batch ids, the next one to be handed out (_nack_part); moving says
-- whether subscriptions are left to move (_rotate_cursors).
create or replace function pgque._switch_rotation(p_name text, p_part smallint,
                                                  p_moving boolean default false)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    update pgque.rotation
       set rt_part = p_part, rt_time = clock_timestamp(), rt_moving = p_moving,
           rt_switch = case p_name
                           when 'cursor' then nextval('pgque.cursor_switch_seq')
                           when 'nack' then coalesce(
                               pg_sequence_last_value('pgque.batch_id_seq'), 0) + 1
                           else rt_switch end
     where rt_name = p_name
$$;

-- pgque._lock_partition(table, part): locks partition part of rotated table
-- (pgque.cursor or pgque.tick) for its truncate: first without queueing for
-- it (_try_lock, for about 25 ms), then queueing for at most 25 ms, so that a
-- stream of short transactions that read the table cannot keep it out for
-- ever (those that come meanwhile wait behind it, that long at most); false
-- when it has not had the lock (the next pass tries again).
create or replace function pgque._lock_partition(p_table text, p_part smallint)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_lock_timeout text := current_setting('lock_timeout');
begin
    if pgque._try_lock(format('lock table pgque.%I in access exclusive mode nowait',
                              p_table || '_' || p_part), 5) then
        return true;
    end if;
    perform set_config('lock_timeout', '25ms', true);
    execute format('lock table pgque.%I in access exclusive mode', p_table || '_' || p_part);
    perform set_config('lock_timeout', v_lock_timeout, true);
    return true;
exception when lock_not_available then
    return false;
end
$$;

-- pgque._rotate_cursors(): the rotation of the cursor log, every rt_period.
-- When anything was written since the last switch, the switch: the writes go
-- to the other partition (emptied before) from then on, and the log is
-- "moving" (rt_moving): a subscription whose newest row is still in the
-- partition left is read there. Each subscription moves at its next cursor
-- write, or when maintenance copies its current cursor over, under its
-- receive lock, taken only if free (a subscription busy now moves itself by
-- its next write). Once every subscription has moved, the move ends, and a
-- period later the partition left, holding superseded rows only, is emptied
-- (so that only a statement older than that could still look into it).
-- Returns how many partitions it emptied, plus one if it switched, plus one
-- if it ended a move; null when it had nothing to do (an idle database
-- rotates nothing) or the rotation row was taken (another rotation, a
-- subscription being made): it tries again at the next pass.
create or replace function pgque._rotate_cursors()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_subs bigint;
    v_switch boolean := false;
    v_moving boolean;
    v_movers integer[];
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'cursor';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_subs := (select count(*) from pgque.subscription);
    if not v_rotation.rt_moving
       and (now() - v_rotation.rt_time < v_rotation.rt_period
            or (not exists (select from pgque.cursor c where c.cur_part = v_other)
                and (select count(*) from (select from pgque.cursor c
                                            where c.cur_part = v_rotation.rt_part
                                            limit v_subs + 1) x) <= v_subs)) then
        return null;  -- the look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('cursor') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    select * into v_rotation from pgque.rotation where rt_name = 'cursor';  -- as locked
    if not v_rotation.rt_moving then
        if exists (select from pgque.cursor c where c.cur_part = v_other) then
            if now() - v_rotation.rt_time < v_rotation.rt_period
               or not pgque._lock_partition('cursor', v_other) then
                return null;
            end if;
            execute format('truncate pgque.%I', 'cursor_' || v_other);
            v_done := 1;
        end if;
        if now() - v_rotation.rt_time < v_rotation.rt_period
           or (select count(*) from (select from pgque.cursor c
                                      where c.cur_part = v_rotation.rt_part
                                      limit v_subs + 1) x) <= v_subs then
            return nullif(v_done, 0);
        end if;
        v_switch := true;
        v_done := v_done + 1;
        v_other := v_rotation.rt_part;  -- the partition left
        v_rotation.rt_part := (v_other + 1) % v_rotation.rt_parts;
    end if;
    -- The subscriptions not moved yet whose receive lock is free: their
    -- receive locks; then (a new statement, so a fresh snapshot: what their
    -- writers committed before is seen) their current cursors copied over.
    v_movers := array(select s.sub_id from pgque.subscription s
                       where not exists (select from pgque.cursor n
                                          where n.cur_part = v_rotation.rt_part
                                            and n.cur_sub = s.sub_id)
                       order by s.sub_id
                         for update skip locked);
    insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                              cur_pos, cur_handed, cur_end, cur_time, cur_part)
    select c.cur_sub, c.cur_seq, c.cur_last_tick, c.cur_batch, c.cur_next_tick,
           c.cur_pos, c.cur_handed, c.cur_end, c.cur_time, v_rotation.rt_part
      from unnest(v_movers) m(sub_id)
     cross join lateral (select o.* from pgque.cursor o
                          where o.cur_part = v_other and o.cur_sub = m.sub_id
                          order by o.cur_seq desc limit 1) c
     where not exists (select from pgque.cursor n
                        where n.cur_part = v_rotation.rt_part and n.cur_sub = m.sub_id);
    v_moving := exists (select from pgque.subscription s
                         where not exists (select from pgque.cursor n
                                            where n.cur_part = v_rotation.rt_part
                                              and n.cur_sub = s.sub_id));
    if v_switch then
        -- The writes go over (to the partition the copies went to) with this commit.
        perform pgque._switch_rotation('cursor', v_rotation.rt_part, v_moving);
    elsif not v_moving then
        update pgque.rotation set rt_moving = false, rt_time = now() where rt_name = 'cursor';
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._ticks_kept(): for every queue, the oldest tick it may still read
-- (_ticks_kept_from: the oldest last finished tick of its subscriptions, or
-- its newest tick when it has none); a tick of the queue from there on is
-- needed, any other tick is not.
create or replace function pgque._ticks_kept(out queues integer[], out kept_from bigint[])
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(array_agg(q.queue_id), '{}'),
           coalesce(array_agg(pgque._ticks_kept_from(q.queue_id)), '{}')
      from pgque.queue q
$$;

-- pgque._needed_tick_in(part, queues, kept_from): whether tick partition part
-- holds a tick that a queue needs (queues and kept_from: _ticks_kept).
create or replace function pgque._needed_tick_in(p_part smallint, p_queues integer[],
                                                 p_kept_from bigint[])
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.tick t
                     join unnest(p_queues, p_kept_from) k(queue_id, kept_from)
                       on k.queue_id = t.tick_queue
                    where t.tick_part = p_part and t.tick_id >= k.kept_from)
$$;

-- pgque._unneeded_tick_in(part, queues, kept_from): whether tick partition
-- part holds a tick that no queue needs.
create or replace function pgque._unneeded_tick_in(p_part smallint, p_queues integer[],
                                                   p_kept_from bigint[])
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.tick t
                     left join unnest(p_queues, p_kept_from) k(queue_id, kept_from)
                       on k.queue_id = t.tick_queue
                    where t.tick_part = p_part
                      and (k.kept_from is null or t.tick_id < k.kept_from))
$$;

-- pgque._tick_idle_queues(part): makes a tick for each queue whose newest
-- tick is in tick partition part, unless another session is ticking it;
-- returns how many. Only under READ COMMITTED (_make_tick's rule): else none.
create or replace function pgque._tick_idle_queues(p_part smallint)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
    v_made integer := 0;
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        return 0;
    end if;
    for v_queue in select q.* from pgque.queue q
                    where (pgque._last_tick(q.queue_id)).tick_part = p_part
                    order by q.queue_id loop
        if pgque._lock_queue(v_queue.queue_id, 'tick', false) then
            perform pgque._make_tick(v_queue);
            v_made := v_made + 1;
        end if;
    end loop;
    return v_made;
end
$$;

-- pgque._rotate_ticks(): the rotation of the ticks. The partition not written
-- is emptied once no queue needs any tick in it (as an event table is once
-- every consumer is past it): a lagging subscription holds it, and the ticks
-- pile up in the partition written until it moves on. The switch comes when
-- rt_period has passed, the partition not written is empty and the one
-- written holds a tick no queue needs. Returns how many partitions it emptied
-- plus one if it switched; null when it had nothing to do or its lock was busy.
-- (Nothing is copied: a tick a cursor names is never emptied, so no reader,
-- whatever its snapshot, misses a tick it needs; see above.)
create or replace function pgque._rotate_ticks()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_kept record;
    v_empty boolean;                 -- the other partition is empty
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'tick';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_empty := not exists (select from pgque.tick t where t.tick_part = v_other);
    if v_empty and now() - v_rotation.rt_time < v_rotation.rt_period then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    v_kept := pgque._ticks_kept();
    if not v_empty and pgque._needed_tick_in(v_other, v_kept.queues, v_kept.kept_from) then
        -- Held by a subscription that has not moved past it. A queue with no
        -- tick since the switch (idle, its ticker_idle_period long) keeps its
        -- newest tick there: a tick now, an empty batch, lets its consumers
        -- move on at their next receive.
        perform pgque._tick_idle_queues(v_other);
        return null;
    end if;
    if v_empty and not pgque._unneeded_tick_in(v_rotation.rt_part, v_kept.queues,
                                               v_kept.kept_from) then
        return null;  -- nothing to switch away from
    end if;
    if pgque._lock_rotation('tick') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if not v_empty then
        if not pgque._lock_partition('tick', v_other) then
            return null;
        end if;
        -- Judged again once locked: a new subscription starts at its queue's
        -- newest tick, which may be there.
        v_kept := pgque._ticks_kept();
        if pgque._needed_tick_in(v_other, v_kept.queues, v_kept.kept_from) then
            return null;
        end if;
        execute format('truncate pgque.%I', 'tick_' || v_other);
        v_empty := true;
        v_done := 1;
    end if;
    if now() - v_rotation.rt_time >= v_rotation.rt_period
       and pgque._unneeded_tick_in(v_rotation.rt_part, v_kept.queues, v_kept.kept_from) then
        perform pgque._switch_rotation('tick', v_other);
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._nack_part(batch_id): the partition of the nack records where the
-- records of batch batch_id go: the partition written now for a batch opened
-- since the last switch (batch_id at or above its rt_switch, the boundary),
-- the other one for an older batch. So every record of one batch goes to one
-- partition, whatever switch a nack's snapshot sees (_rotate_nacks switches
-- only while no batch below the boundary is open), and the key of
-- pgque.batch_nack catches a repeated nack in REPEATABLE READ too (40001).
-- Under READ COMMITTED the rotation row is read FOR SHARE, held until the
-- nack's transaction ends: a switch in flight has set its boundary below the
-- batch ids handed out before it commits, so a nack that read the row as it
-- was before would put such a batch's records in the other partition than a
-- nack after it; it waits for the switch instead (and no switch comes while
-- a nack holds the row). A REPEATABLE READ or SERIALIZABLE nack reads the
-- row its snapshot sees (FOR SHARE would fail it with 40001 after any
-- switch); for it that window remains (docs/design-notes.md).
create or replace function pgque._nack_part(p_batch_id bigint)
returns smallint
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
begin
    if current_setting('transaction_isolation') = 'read committed' then
        select * into v_rotation from pgque.rotation r where r.rt_name = 'nack' for share;
    else
        select * into v_rotation from pgque.rotation r where r.rt_name = 'nack';
    end if;
    return case when p_batch_id >= v_rotation.rt_switch then v_rotation.rt_part
                else (v_rotation.rt_part + 1) % v_rotation.rt_parts end;
end
$$;

-- pgque._open_batch_below(batch_id): whether a subscription has a batch open
-- whose id is below batch_id, or a cursor this snapshot cannot find (counted
-- as one, to be safe).
create or replace function pgque._open_batch_below(p_batch_id bigint)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.subscription s
                    cross join lateral pgque._current_cursor(s.sub_id, false) c
                    where c.cur_sub is null or c.cur_batch < p_batch_id)
$$;

-- pgque._rotate_nacks(): the rotation of the nack records. A record is needed
-- while its batch is open (it keeps a repeated nack from counting twice).
-- Records go to the partition of their batch (_nack_part): batches opened
-- since the last switch to the partition written, older ones to the other.
-- Once no batch older than the last switch is open, the other partition holds
-- only records of finished batches and is emptied; then, when rt_period has
-- passed and the partition written holds a record, the switch: the writes of
-- batches opened from now on go to the emptied one, and the boundary becomes
-- the next batch id. A batch held open holds both (the records pile up in
-- the partition written until it ends). Nothing is copied. Returns how many
-- partitions it emptied plus one if it switched; null when it had nothing to
-- do or its lock was busy.
create or replace function pgque._rotate_nacks()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_empty boolean;                 -- the other partition is empty
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'nack';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_empty := not exists (select from pgque.batch_nack b where b.bn_part = v_other);
    if v_empty and (now() - v_rotation.rt_time < v_rotation.rt_period
                    or not exists (select from pgque.batch_nack b
                                    where b.bn_part = v_rotation.rt_part)) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._open_batch_below(v_rotation.rt_switch) then
        return null;  -- a batch older than the last switch is still open
    end if;
    if pgque._lock_rotation('nack') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if not v_empty then
        if not pgque._lock_partition('batch_nack', v_other) then
            return null;
        end if;
        if pgque._open_batch_below(v_rotation.rt_switch) then
            return null;  -- judged again once locked: no nack writes there now
        end if;
        execute format('truncate pgque.%I', 'batch_nack_' || v_other);
        v_done := 1;
    end if;
    if now() - v_rotation.rt_time >= v_rotation.rt_period
       and exists (select from pgque.batch_nack b where b.bn_part = v_rotation.rt_part) then
        -- Every batch id handed out so far is below the new boundary: those
        -- batches' records stay where they go now (the partition left).
        perform pgque._switch_rotation('nack', v_other);
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._rotate_retries(): the rotation of the retry queue. A retry row is
-- needed until it is moved back into the log (_maint_retry marks it in
-- pgque.retry_moved, in the same partition). The partition not written is
-- emptied, with its marks, after the retries still waiting in it (due later)
-- are copied, with their numbers, into the partition written; then, when
-- rt_period has passed and the partition written holds a row, the switch.
-- Returns how many partitions it emptied plus one if it switched; null when
-- it had nothing to do or its lock was busy. (A mover whose snapshot predates
-- the copy and that reads the partitions after it sees neither the rows
-- emptied nor their copies: it moves them at its next pass, never twice.)
create or replace function pgque._rotate_retries()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_empty boolean;                 -- the other partition is empty
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'retry';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_empty := not exists (select from pgque.retry_queue r where r.rq_part = v_other)
               and not exists (select from pgque.retry_moved m where m.rm_part = v_other);
    if v_empty and (now() - v_rotation.rt_time < v_rotation.rt_period
                    or not exists (select from pgque.retry_queue r
                                    where r.rq_part = v_rotation.rt_part)) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('retry') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if not v_empty then
        if not pgque._lock_partition('retry_queue', v_other) then
            return null;
        end if;
        if not pgque._lock_partition('retry_moved', v_other) then
            return null;
        end if;
        -- Locked: no nack or mover writes there now, and this statement's
        -- snapshot sees all they committed.
        insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time,
                                       ev_retry, ev_type, ev_data, ev_extra1, ev_delayed_id,
                                       rq_id, rq_part)
        select r.ev_retry_after, r.ev_queue, r.ev_owner, r.ev_id, r.ev_time,
               r.ev_retry, r.ev_type, r.ev_data, r.ev_extra1, r.ev_delayed_id, r.rq_id,
               v_rotation.rt_part
          from pgque._retry_waiting r
         where r.rq_part = v_other;
        execute format('truncate pgque.%I, pgque.%I',
                       'retry_queue_' || v_other, 'retry_moved_' || v_other);
        v_done := 1;
    end if;
    if now() - v_rotation.rt_time >= v_rotation.rt_period
       and exists (select from pgque.retry_queue r where r.rq_part = v_rotation.rt_part) then
        perform pgque._switch_rotation('retry', v_other);
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._rotate_held(): the rotation of the held events of blocked keys
-- (slots/pause.sql), as the retry queue's: a held event is needed while its
-- key's marker has not moved past it. The partition not written is emptied
-- after the held events still needed in it are copied, with their numbers,
-- into the partition written; then, when rt_period has passed and the
-- partition written holds a row, the switch. Returns how many partitions it
-- emptied plus one if it switched; null when it had nothing to do or its lock
-- was busy. The copy and the truncate commit together, so a reader sees the
-- rows or their copies, never both and never neither.
create or replace function pgque._rotate_held()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_empty boolean;                 -- the other partition is empty
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'held';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_empty := not exists (select from pgque.held_event h where h.he_part = v_other);
    if v_empty and (now() - v_rotation.rt_time < v_rotation.rt_period
                    or not exists (select from pgque.held_event h
                                    where h.he_part = v_rotation.rt_part)) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('held') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if not v_empty then
        if not pgque._lock_partition('held_event', v_other) then
            return null;
        end if;
        -- Locked: no receive or ack writes there now, and this statement's
        -- snapshot sees all they committed.
        insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                      ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
        select h.he_sub, h.he_key, h.he_seq, h.he_batch, h.ev_id, h.ev_time, h.ev_txid,
               h.ev_retry, h.ev_type, h.ev_data, h.ev_delayed_id, v_rotation.rt_part
          from pgque.held_event h
          join pgque.blocked_key b on b.bk_sub = h.he_sub and b.bk_key = h.he_key
         where h.he_part = v_other and h.he_seq > b.bk_done_seq;
        execute format('truncate pgque.%I', 'held_event_' || v_other);
        v_done := 1;
    end if;
    if now() - v_rotation.rt_time >= v_rotation.rt_period
       and exists (select from pgque.held_event h where h.he_part = v_rotation.rt_part) then
        perform pgque._switch_rotation('held', v_other);
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._rotate_delayed(): the rotation of the delayed events (log/delay.sql).
-- A delayed row is needed until its queue's newest tick has moved it into the
-- log; the rows of a dropped queue are not needed. Once per rt_period (rt_time
-- is the last look, or switch), when the table holds anything, it counts the
-- rows needed and not in the partition not written: when those not needed
-- (there, and in the one written, which the next look empties) are at least
-- as many as those needed there, it copies those into the partition written
-- as they are (under their queues' tick locks, so no tick judges them in
-- between), empties the other with TRUNCATE and switches to it. Each row copied is so paid for by one emptied, and the rows
-- kept that are not needed are fewer than those needed plus a period's sends.
-- When the partition not written is empty already, the switch alone. Returns
-- how many partitions it emptied plus one if it switched; null when it did
-- nothing of either, or its lock was busy.
create or replace function pgque._rotate_delayed()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_counts record;
    v_queue integer;
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'delayed';
    if now() - v_rotation.rt_time < v_rotation.rt_period
       or not exists (select from pgque.delayed_event) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('delayed') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    -- Needed or not, as of each queue's newest tick (its snapshot aside:
    -- a count to decide by, not the copy).
    with last as (select t.* from pgque.queue q cross join lateral pgque._last_tick(q.queue_id) t)
    select count(*) filter (where d.de_part = v_other and l.tick_queue is not null
                              and (l.tick_time is null or d.de_due > l.tick_time)) as needed,
           count(*) filter (where d.de_part = v_other
                              and (l.tick_queue is null or d.de_due <= l.tick_time)) as done_other,
           count(*) filter (where d.de_part = v_rotation.rt_part
                              and (l.tick_queue is null or d.de_due <= l.tick_time)) as done_written,
           count(*) filter (where d.de_part = v_other) as other
      into v_counts
      from pgque.delayed_event d left join last l on l.tick_queue = d.de_queue;
    if v_counts.other > 0 and v_counts.done_other + v_counts.done_written >= v_counts.needed then
        -- The tick locks of the queues with rows there, without waiting: no
        -- tick runs while the rows are copied, so each queue's newest tick
        -- stays the one that judged them, and the copies keep their
        -- transaction ids (a tick reads them as it read the originals).
        -- Before the partition's lock, in the ticks' own order.
        for v_queue in select q.queue_id from pgque.queue q
                        where exists (select from pgque.delayed_event d
                                       where d.de_part = v_other and d.de_queue = q.queue_id)
                        order by q.queue_id loop
            if not pgque._lock_queue(v_queue, 'tick', false) then
                return null;  -- a tick runs: the next pass
            end if;
        end loop;
        if not pgque._lock_partition('delayed_event', v_other) then
            return null;
        end if;
        -- Locked: no tick moves rows from there now, no sender writes there,
        -- and this statement's snapshot sees all they committed.
        insert into pgque.delayed_event (de_queue, de_due, ev_id, ev_time, ev_txid, ev_type,
                                         ev_data, ev_extra1, de_part)
        select d.de_queue, d.de_due, d.ev_id, d.ev_time, d.ev_txid, d.ev_type, d.ev_data,
               d.ev_extra1, v_rotation.rt_part
          from pgque.delayed_event d
          join pgque.queue q on q.queue_id = d.de_queue
         cross join lateral pgque._last_tick(q.queue_id) l
         where d.de_part = v_other
           and not coalesce(d.de_due <= l.tick_time
                            and pg_visible_in_snapshot(d.ev_txid, l.tick_snapshot), false);
        execute format('truncate pgque.%I', 'delayed_event_' || v_other);
        v_done := 1;
    end if;
    if v_done = 1 or v_counts.other = 0 then
        perform pgque._switch_rotation('delayed', v_other);
        return v_done + 1;
    end if;
    -- Not worth it yet: look again a period from now.
    update pgque.rotation set rt_time = now() where rt_name = 'delayed';
    return null;
end
$$;

-- pgque._rotate_idempotency(): the rotation of the idempotency keys
-- (log/idempotency.sql). Every key in the partition not written was recorded
-- before the last switch (rt_time); once the longest idempotency window of any
-- queue has passed since, all of them have expired: it empties that partition
-- with TRUNCATE, and switches the writes to it, under the table in SHARE mode,
-- which it has only while no sender is in flight (it tries, never queues).
-- A key is so remembered for one to two windows. Returns how many partitions
-- it emptied plus one if it switched; null when it did nothing of either.
create or replace function pgque._rotate_idempotency()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'idempotency';
    if now() - v_rotation.rt_time < coalesce((select max(q.queue_idempotency_window)
                                                 from pgque.queue q), interval '24 hours')
       or not exists (select from pgque.idempotency_key) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('idempotency') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or a REPEATABLE READ sender holds the row
    end if;
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    if exists (select from pgque.idempotency_key k where k.ik_part = v_other) then
        if not pgque._lock_partition('idempotency_key', v_other) then
            return null;
        end if;
        execute format('truncate pgque.%I', 'idempotency_key_' || v_other);
        v_done := 1;
    end if;
    if not pgque._try_lock('lock table only pgque.idempotency_key in share mode nowait', 5) then
        return nullif(v_done, 0);  -- senders in flight: the switch at a later pass
    end if;
    perform pgque._switch_rotation('idempotency', v_other);
    return v_done + 1;
end
$$;

-- ===== code/ticker/sleep.sql =====
-- pgque: the sleeping ticker.
--
-- A ticker that polls every few milliseconds delivers the first event after
-- a quiet spell quickly, and costs a core a few percent for it all day; and
-- one that polls every queue every few milliseconds costs, in a database of
-- thousands of queues, a core for the few that are busy. So the active Ticker
-- polls often only the queues that were busy lately (its hot queues), and lets
-- the others sleep: it sets their queue_ticker_asleep (ticker_sleep, every
-- queue but the hot ones), LISTENs on the ticker channel, and looks at every
-- queue only now and then. A send into a queue whose flag is set notifies the
-- channel at its commit, the queue's id as the payload; the ticker looks at
-- that queue at once, and when the look ticks something it clears its flag
-- (ticker_wake) and polls it often until it is quiet again. With no hot queue
-- the whole ticker sleeps. The flags are written when a queue falls asleep and
-- when it wakes, never per send (a look at every queue marks only queues made
-- or skipped since): an idle queue writes no more WAL than before, and a busy
-- one never notifies.
--
-- A send whose statement read the flag before the ticker set it, and which
-- commits after the ticker's look that follows, sends no notification: its
-- events wait for the next look at every queue. So does whatever becomes due
-- without a send: retries, delayed events, the idle period's ticks.
--
-- Only the session that holds the ticker election sets or clears the flags,
-- and a newly elected ticker (a Python Ticker, pg_cron's ticker_loop) clears
-- them first; a Ticker that stops clears them too. One that went away asleep
-- leaves its queues notifying nobody (cheap) until the next one is elected.
--
-- The flags are written without waiting: a queue row another transaction
-- holds (maintenance rotating it, alter_queue) is skipped and marked at the
-- ticker's next look at every queue, which also marks queues created
-- meanwhile. The row lock is FOR NO KEY UPDATE, which the foreign-key checks'
-- FOR KEY SHARE (a subscribe in a transaction left open, say) does not block.
--
-- PREPARE TRANSACTION refuses a transaction that ran NOTIFY, so where the
-- server allows prepared transactions (max_prepared_transactions > 0) sends
-- never notify, and the ticker does not sleep.

-- pgque._ticker_channel(): the channel a sleeping ticker listens on.
create or replace function pgque._ticker_channel()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'pgque_ticker' $$;

-- pgque.ticker_channel(): the channel to LISTEN on to hear of sends into queues
-- whose ticker sleeps (one notification per sending transaction and queue,
-- the queue's id as its payload).
create or replace function pgque.ticker_channel()
returns text
language sql immutable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._ticker_channel() $$;

-- pgque._wake_ticker(queue_id): notifies the ticker channel at the caller's
-- commit that the queue has something new, unless the server allows prepared
-- transactions (see the top). The senders call it when the queue row they
-- read says the queue sleeps. The payload only says where to look at once:
-- the ticker's look at every queue, once a second, covers a notification
-- lost or unread.
create or replace function pgque._wake_ticker(p_queue_id integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._ticker_may_sleep() then
        return;
    end if;
    perform pg_notify(pgque._ticker_channel(), p_queue_id::text);
end
$$;

-- pgque._ticker_may_sleep(): whether sends may notify the ticker: not where a
-- sending transaction could be prepared (PREPARE refuses a NOTIFY).
create or replace function pgque._ticker_may_sleep()
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return current_setting('max_prepared_transactions')::integer = 0;
end
$$;

-- pgque._require_elected(action): raises 55000 unless this session holds the
-- ticker election: only the active ticker listens, so only it may say that
-- it sleeps.
create or replace function pgque._require_elected(p_action text)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._holds_key(pgque._ticker_key()) then
        raise exception using errcode = '55000',
            message = format('only the active ticker may %s', p_action),
            hint = 'Call pgque.claim_ticker() on this session first.';
    end if;
end
$$;

-- pgque.ticker_sleep(except): marks every queue's ticker as asleep but those
-- whose ids are in except (null: every queue), so that sends into them notify
-- the ticker channel; returns how many queues it marked (none when they all
-- were, or when a queue row was busy: it is skipped, see the top), or null
-- where the ticker must not sleep (prepared transactions allowed; nothing
-- marked). For the active ticker only (55000 otherwise), which must LISTEN on
-- ticker_channel() before, and look for due ticks in the queues it marked
-- once more after, its commit (a send may have read the flags before it);
-- it calls this again at each look at every queue, for the queues skipped or
-- created.
create or replace function pgque.ticker_sleep(p_except integer[] default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_count integer;
begin
    perform pgque._require_elected('sleep');
    if not pgque._ticker_may_sleep() then
        return null;
    end if;
    update pgque.queue q set queue_ticker_asleep = true
     where q.queue_id in (select l.queue_id from pgque.queue l
                           where not l.queue_ticker_asleep
                             and (p_except is null or l.queue_id <> all(p_except))
                           for no key update skip locked);
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- pgque.ticker_wake(queues): marks the ticker of the queues whose ids are in
-- queues (null: every queue) as awake again, so that sends into them stop
-- notifying; returns how many queues it marked. For the active ticker only
-- (55000 otherwise): when a queue wakes, and for every queue when it is
-- elected (its predecessor may have gone away asleep) and when it stops.
create or replace function pgque.ticker_wake(p_queues integer[] default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_count integer;
begin
    perform pgque._require_elected('wake');
    -- Waits for a busy row (briefly: the writers of queue rows are short), as
    -- a queue left marked would notify for nothing. FOR NO KEY UPDATE, which
    -- foreign-key checks never block, in queue_id order, as maintenance takes
    -- the rows: no deadlock with it.
    update pgque.queue q set queue_ticker_asleep = false
     where q.queue_id in (select l.queue_id from pgque.queue l
                           where l.queue_ticker_asleep
                             and (p_queues is null or l.queue_id = any(p_queues))
                           order by l.queue_id for no key update);
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- ===== code/info/info.sql =====
-- pgque: what operators look at: queues, consumers, consumer groups and their
-- slots, the active ticker.
--
-- Stalls: a queue is stalled when events wait for a tick and nobody ticks it,
-- a slot when an event waits and nobody moves the slot, each judged against a
-- threshold (stalled_after) that the caller may give and that defaults to the
-- queue's own (_stalled_after).

-- pgque._oldest_unconsumed(queue_id, sub_id, snapshot, slot, slots): ev_time
-- of the earliest-written event the subscription has not consumed yet (not
-- visible in the snapshot of its last finished tick; only the slot's events
-- when slots is given), or null. Reads the ev_txid index upward from the
-- snapshot's xmin and stops at the first such event.
create or replace function pgque._oldest_unconsumed(
    p_queue_id integer, p_sub_id integer, p_snapshot pg_snapshot,
    p_slot integer default null, p_slots integer default null)
returns timestamptz
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '100ms'
as $$
declare
    v_time timestamptz;
begin
    begin
        execute format(
            'select e.ev_time from pgque.%I e'
            ' where e.ev_txid >= $1 and not pg_visible_in_snapshot(e.ev_txid, $2)'
            '   and (e.ev_owner is null or e.ev_owner = $3)%s'
            ' order by e.ev_txid limit 1',
            pgque._event_table(p_queue_id), pgque._slot_filter(p_slots, '$4'))
           into v_time
          using pg_snapshot_xmin(p_snapshot), p_snapshot, p_sub_id, p_slot, p_slots;
        return v_time;
    exception when undefined_table or lock_not_available then
        -- The queue was dropped after the caller's statement began, or is being
        -- dropped (see _sequence_value).
        null;  -- (a lock timeout left pending is raised here: see pgque._seq_before)
    end;
    return null;
exception when lock_not_available then
    return null;
end
$$;

-- pgque._sequence_value(seq): the last value of the queue's event sequence
-- seq (pg_sequence_last_value; 0 before its first use), or null when it
-- cannot be read: once drop_queue dropped it, or while one holds it. The info
-- views read queue rows that their statement's snapshot still shows, while
-- the sequence is looked up as it is now. Like the info views' other reads of
-- a queue's tables (_oldest_unconsumed, _pending_events, _queue_stalled), it
-- waits at most 100 ms for a lock: a view that holds the locks of the queues
-- it read so far and waits on one that drop_queue holds could close a cycle
-- with it, and would hang `pgque status` behind the drop; it answers null
-- (false) for that queue instead.
create or replace function pgque._sequence_value(p_seq regclass)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '100ms'
as $$
declare
    v_value bigint;
begin
    begin
        v_value := coalesce(pg_sequence_last_value(p_seq), 0);
        return v_value;  -- (a statement of its own: see pgque._seq_before)
    exception when undefined_table or internal_error or lock_not_available then
        -- "could not open relation with OID": the sequence is gone.
        null;  -- (a lock timeout left pending is raised here: see pgque._seq_before)
    end;
    return null;
exception when lock_not_available then
    return null;
end
$$;

-- pgque._stalled_after(queue): the queue's own stall threshold: twice its
-- ticker_idle_period, and at least 10 seconds. A running ticker ticks every
-- queue at least once per ticker_idle_period (events that wait, sooner), so
-- twice that is late; the floor keeps a short period from flagging a ticker's
-- hiccups (pg_cron's ticker_loop pauses about 2 seconds a minute).
create or replace function pgque._stalled_after(p_queue pgque.queue)
returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select greatest(2 * p_queue.queue_ticker_idle_period, interval '10 seconds') $$;

-- pgque._check_stalled_after(after): 22023 for a negative threshold; null
-- (the queues' own) and zero (any wait) are fine.
create or replace function pgque._check_stalled_after(p_after interval)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_after < interval '0' then
        raise exception using errcode = '22023',
            message = format('stalled_after must not be negative, not %s', p_after);
    end if;
end
$$;

-- pgque._queue_stalled(queue_id, last_tick_id, last_tick_age, after): whether
-- nobody ticks the queue: its newest tick (last_tick_id) is older than after,
-- or there is none, and committed events wait for a tick: events that tick's
-- snapshot does not cover (_uncovered_events), or with no tick any event. Not
-- events_since_last_tick, which counts sequence positions: a send that rolled
-- back takes them but leaves no event, and an idle queue is never stalled.
-- Reads the event tables (an index probe on ev_txid each, as the ticker's
-- _tick_due does) only when the tick is old enough.
create or replace function pgque._queue_stalled(
    p_queue_id integer, p_tick_id bigint, p_tick_age interval, p_after interval)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '100ms'
as $$
declare
    v_snapshot pg_snapshot;
    v_found boolean;
begin
    begin
        if p_tick_age <= p_after then
            return false;
        end if;
        if p_tick_id is null then
            execute format('select exists (select 1 from pgque.%I)', pgque._event_table(p_queue_id))
               into v_found;
            return v_found;
        end if;
        select t.tick_snapshot into v_snapshot
          from pgque.tick t
         where t.tick_queue = p_queue_id and t.tick_id = p_tick_id;
        v_found := coalesce(pgque._uncovered_events(p_queue_id, v_snapshot), false);
        return v_found;  -- (a statement of its own: see pgque._seq_before)
    exception when undefined_table or lock_not_available then
        null;  -- (a lock timeout left pending is raised here: see pgque._seq_before)
    end;
    return false;  -- the queue is being dropped, or was (see _sequence_value)
exception when lock_not_available then
    return false;
end
$$;

-- pgque._slot_stalled(oldest_unconsumed_age, owner_pid, last_active, after):
-- whether a slot looks stalled: an event has waited longer than after, and
-- nobody owns the slot or it has not moved (no receive or ack) for that long.
-- False when nothing waits.
create or replace function pgque._slot_stalled(
    p_oldest interval, p_owner integer, p_last_active timestamptz, p_after interval)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(p_oldest > p_after
                    and (p_owner is null or now() - p_last_active > p_after), false)
$$;

-- pgque._queue_info: one row per queue with its settings, its newest tick,
-- how many events were sent since that tick (by sequence position: sends
-- that rolled back count too), its subscriptions (all of them: get_queue_info
-- counts a non-admin's only), whether it is stalled by its own threshold
-- (_queue_stalled, which looks for committed events instead), its delayed
-- events not in the log yet (how many, the next due) and the idempotency keys
-- it remembers (those two count rows: status, not a hot path).
create or replace view pgque._queue_info as
select q.queue_name,
       q.queue_id,
       q.queue_ntables as event_tables,
       q.queue_cur_table as current_table,
       q.queue_rotation_period as rotation_period,
       q.queue_switch_time as last_rotation,
       q.queue_ticker_max_count as ticker_max_count,
       q.queue_ticker_max_lag as ticker_max_lag,
       q.queue_ticker_idle_period as ticker_idle_period,
       q.queue_max_retries as max_retries,
       t.tick_id as last_tick_id,
       t.tick_time as last_tick_time,
       now() - t.tick_time as last_tick_age,
       e.event_seq,
       e.events_since_last_tick,
       (select count(*) from pgque.subscription s where s.sub_queue = q.queue_id) as consumers,
       pgque._stalled_after(q) as stalled_after,
       pgque._queue_stalled(q.queue_id, t.tick_id, now() - t.tick_time,
                            pgque._stalled_after(q)) as stalled,
       d.waiting as delayed_events,
       d.next_due as next_delivery,
       q.queue_idempotency_window as idempotency_window,
       pgque._idempotency_keys(q) as idempotency_keys
  from pgque.queue q
  cross join lateral pgque._delayed_waiting(q.queue_id) d
  left join lateral (select * from pgque.tick t where t.tick_queue = q.queue_id
                      order by t.tick_id desc limit 1) t on true
  cross join lateral (
      select coalesce(pgque._sequence_value(q.queue_event_seq), 0) as event_seq,
             greatest(coalesce(pgque._sequence_value(q.queue_event_seq), 0)
                      - coalesce(t.tick_event_seq, 0), 0) as events_since_last_tick) e;

-- pgque._consumer_info: one row per subscription: where its cursor is, how far
-- behind it is (ticks, events by sequence position, time), its open batch and
-- the age of its oldest unconsumed event.
create or replace view pgque._consumer_info as
select q.queue_name,
       s.sub_consumer as consumer_name,
       s.sub_id,
       c.cur_last_tick as last_tick_id,
       t.tick_time as last_tick_time,
       now() - t.tick_time as lag,
       (select count(*) from pgque.tick n
         where n.tick_queue = q.queue_id and n.tick_id > c.cur_last_tick) as ticks_behind,
       greatest(coalesce(pgque._sequence_value(q.queue_event_seq), 0)
                - coalesce(t.tick_event_seq, 0), 0) as pending_events,
       c.cur_batch as open_batch_id,
       c.cur_time as last_active,
       now() - pgque._oldest_unconsumed(q.queue_id, s.sub_id, t.tick_snapshot)
           as oldest_unconsumed_age,
       (select count(*) from pgque._retry_waiting r where r.ev_owner = s.sub_id) as retries_waiting,
       (select count(*) from pgque.dead_letter d where d.dl_sub = s.sub_id) as dead_letters
  from pgque.subscription s
  join pgque.queue q on q.queue_id = s.sub_queue
  cross join lateral pgque._current_cursor(s.sub_id) c
  left join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick;

-- pgque._pending_events(queue_id, sub_id, snapshot, slot, slots): how many
-- committed events the subscription has not consumed yet (not visible in the
-- snapshot of its last finished tick), only the slot's when slots is given.
-- Counts at most one million, to bound the cost of looking.
create or replace function pgque._pending_events(
    p_queue_id integer, p_sub_id integer, p_snapshot pg_snapshot,
    p_slot integer default null, p_slots integer default null)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '100ms'
as $$
declare
    v_count bigint;
begin
    begin
        execute format(
            'select count(*) from (select 1 from pgque.%I e'
            ' where e.ev_txid >= $1 and not pg_visible_in_snapshot(e.ev_txid, $2)'
            '   and (e.ev_owner is null or e.ev_owner = $3)%s'
            ' limit 1000000) pending',
            pgque._event_table(p_queue_id), pgque._slot_filter(p_slots, '$4'))
           into v_count
          using pg_snapshot_xmin(p_snapshot), p_snapshot, p_sub_id, p_slot, p_slots;
        return v_count;
    exception when undefined_table or lock_not_available then
        -- The queue was dropped after the caller's statement began, or is being
        -- dropped (see _sequence_value).
        null;  -- (a lock timeout left pending is raised here: see pgque._seq_before)
    end;
    return null;
exception when lock_not_available then
    return null;
end
$$;

-- pgque._partition_slot_status: one row per slot of every consumer group:
-- its owner (the backend holding the slot's advisory lock, and the
-- application name that session set: pg_stat_activity shows it to every
-- role, unlike the backend's start or its query), the slot's current epoch
-- (slots/fence.sql), how much it has not consumed, its retries and dead letters,
-- and whether it looks stalled by the queue's own threshold (_slot_stalled).
create or replace view pgque._partition_slot_status as
select q.queue_name,
       g.cg_consumer as consumer_name,
       k.slot,
       g.cg_slots as slots,
       l.pid as owner_pid,
       l.name as owner_name,
       e.sc_epoch as epoch,
       pgque._pending_events(q.queue_id, s.sub_id, t.tick_snapshot, k.slot, g.cg_slots)
           as pending_events,
       (select count(*) from pgque.tick n
         where n.tick_queue = q.queue_id and n.tick_id > c.cur_last_tick) as ticks_behind,
       o.age as oldest_unconsumed_age,
       now() - t.tick_time as lag,
       c.cur_batch as open_batch_id,
       c.cur_time as last_active,
       (select count(*) from pgque._retry_waiting r where r.ev_owner = s.sub_id) as retries_waiting,
       (select count(*) from pgque.dead_letter d where d.dl_sub = s.sub_id) as dead_letters,
       pgque._stalled_after(q) as stalled_after,
       pgque._slot_stalled(o.age, l.pid, c.cur_time, pgque._stalled_after(q)) as stalled,
       b.blocked_keys,
       b.oldest_blocked_age
  from pgque.consumer_group g
  join pgque.queue q on q.queue_id = g.cg_queue
  cross join lateral generate_series(0, g.cg_slots - 1) as k(slot)
  join pgque.subscription s
    on s.sub_queue = g.cg_queue and s.sub_consumer = pgque._slot_name(g.cg_consumer, k.slot, g.cg_slots)
  cross join lateral pgque._current_cursor(s.sub_id) c
  left join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick
  -- Read once: both the age column and the stalled flag need it.
  cross join lateral (select now() - pgque._oldest_unconsumed(q.queue_id, s.sub_id,
                                        t.tick_snapshot, k.slot, g.cg_slots) as age) o
  -- The owner: the session holding the slot's key exclusively, if its role
  -- may use the group (see slots/groups.sql); null for a name it did not set.
  left join lateral (select k.pid, nullif(a.application_name, '') as name
                       from pgque._key_sessions(s.sub_lock_key) k
                       left join pg_stat_activity a on a.pid = k.pid
                      where k.granted and k.mode = 'ExclusiveLock'
                        and pgque._may_consume(k.role, q, g.cg_owner, g.cg_grantees)
                      limit 1) l on true
  left join pgque.slot_claim e on e.sc_sub = s.sub_id
  -- The pause policy's blocked keys (slots/pause.sql) and how long the oldest
  -- has waited for its head.
  cross join lateral (select count(*) as blocked_keys,
                             now() - min(x.bk_since) as oldest_blocked_age
                        from pgque.blocked_key x where x.bk_sub = s.sub_id) b;

-- pgque._group_info: one row per consumer group: its slot count, its live
-- members (sessions holding one of its member keys, see join_group), how many
-- slots have an owner and the newest epoch of its slots. Only sessions whose
-- roles may use the group count, as in group_status. pg_locks is read once.
create or replace view pgque._group_info as
with locks as materialized (
    -- Advisory locks are per database, but pg_locks shows the whole cluster.
    select l.classid, l.objid, l.objsubid, l.pid, a.usesysid as role
      from pg_locks l
      left join pg_stat_activity a on a.pid = l.pid
     where l.locktype = 'advisory' and l.granted and l.mode = 'ExclusiveLock'
       and l.database = (select oid from pg_database where datname = current_database()))
select q.queue_name,
       g.cg_consumer as consumer_name,
       g.cg_slots as slots,
       (select count(distinct k.pid) from locks k
         where k.objsubid = 2 and k.classid = pgque._member_class(g)::oid
           and pgque._may_consume(k.role, q, g.cg_owner, g.cg_grantees))::integer as members,
       (select count(*)
          from pgque.subscription s
         where s.sub_queue = q.queue_id
           and s.sub_consumer = any (array(
                   select pgque._slot_name(g.cg_consumer, n, g.cg_slots)
                     from generate_series(0, g.cg_slots - 1) n))
           and exists (select 1 from locks k
                        where k.objsubid = 1
                          and k.classid = ((s.sub_lock_key >> 32) & 4294967295)::oid
                          and k.objid = (s.sub_lock_key & 4294967295)::oid
                          and pgque._may_consume(k.role, q, g.cg_owner, g.cg_grantees))
       )::integer as owned_slots,
       (select max(c.sc_epoch)
          from pgque.subscription s
          join pgque.slot_claim c on c.sc_sub = s.sub_id
         where s.sub_queue = q.queue_id
           and s.sub_consumer = any (array(
                   select pgque._slot_name(g.cg_consumer, n, g.cg_slots)
                     from generate_series(0, g.cg_slots - 1) n))) as newest_epoch,
       g.cg_policy as failure_policy,
       g.cg_max_attempts as max_attempts,
       g.cg_pause_timeout as pause_timeout,
       g.cg_max_retries as max_retries,
       (select count(*)
          from pgque.subscription s
          join pgque.blocked_key b on b.bk_sub = s.sub_id
         where s.sub_queue = q.queue_id
           and s.sub_consumer = any (array(
                   select pgque._slot_name(g.cg_consumer, n, g.cg_slots)
                     from generate_series(0, g.cg_slots - 1) n))) as blocked_keys,
       (select count(*)
          from pgque.subscription s
          join pgque.dead_letter d on d.dl_sub = s.sub_id
         where s.sub_queue = q.queue_id
           and s.sub_consumer = any (array(
                   select pgque._slot_name(g.cg_consumer, n, g.cg_slots)
                     from generate_series(0, g.cg_slots - 1) n))) as dead_letters
  from pgque.consumer_group g
  join pgque.queue q on q.queue_id = g.cg_queue;

-- The info views read event tables and sequences that callers have no
-- privileges on, so they are reached through SECURITY DEFINER functions,
-- which show a caller that is not an admin only what it may use: the queues
-- it may send to or consume from, the consumers it may use (see base/access.sql).

-- pgque._caller_access(): the caller's role (its oid) and whether it is an
-- admin, worked out once per call, not once per row.
create or replace function pgque._caller_access(out role oid, out admin boolean)
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select pgque._role_id(c), pgque._is_admin(c) from pgque._caller() c $$;

-- pgque._may_send_at_all(role) / pgque._may_consume_at_all(role): whether role
-- (an oid), or a role it is a member of, may run a send (pgque_writer, or a
-- role granted EXECUTE on one) / a receive (pgque_reader, or likewise): the
-- role-wide bound that a queue's grants only narrow.
create or replace function pgque._may_send_at_all(p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._may_execute(p_role, to_regprocedure('pgque.send(text,text,jsonb,text)'))
        or pgque._may_execute(p_role, to_regprocedure('pgque.send(text,text,text,text)'))
        or pgque._may_execute(p_role, to_regprocedure('pgque.send_batch(text,text[],text[],text[])'))
$$;

create or replace function pgque._may_consume_at_all(p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._may_execute(p_role, to_regprocedure('pgque.receive(text,text,integer)'))
        or pgque._may_execute(
               p_role, to_regprocedure('pgque.receive_partitioned(text,text,integer,integer,integer)'))
$$;

-- pgque._may_see_queue(queue, role, sends, consumes): whether a caller acting
-- as role (an oid) that is not an admin may see the queue: it may send to it
-- (sends: it may send at all, _may_send_at_all, and the queue's 'send' grants
-- let it in) or consume from it (consumes, _may_consume_at_all, and the
-- 'consume' grants). A queue without grants of a kind lets in every role that
-- may do that at all, and no other: a reader does not see a queue whose
-- 'consume' grants leave it out because anyone may send there.
create or replace function pgque._may_see_queue(
    p_queue pgque.queue, p_role oid, p_sends boolean, p_consumes boolean)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select (p_sends and (p_queue.queue_senders is null
                         or pgque._in_roles(p_role, p_queue.queue_senders)))
        or (p_consumes and (p_queue.queue_consumers is null
                            or pgque._in_roles(p_role, p_queue.queue_consumers)))
$$;

-- pgque.get_queue_info(stalled_after): the rows of pgque.queue_info, with
-- stalled judged against stalled_after when given (else each queue's own,
-- _stalled_after; 22023 when negative). A caller that is not an admin sees
-- the queues it may send to or consume from, and their consumers counts only
-- the subscriptions it may use (those consumer_info shows it).
create or replace function pgque.get_queue_info(p_stalled_after interval default null)
returns setof pgque._queue_info
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_me record;
    v_sends boolean := false;
    v_consumes boolean := false;
    r pgque._queue_info;
begin
    perform pgque._check_stalled_after(p_stalled_after);
    select * into v_me from pgque._caller_access();
    if not v_me.admin then
        v_sends := pgque._may_send_at_all(v_me.role);
        v_consumes := pgque._may_consume_at_all(v_me.role);
    end if;
    for r in select i.* from pgque._queue_info i
               join pgque.queue q on q.queue_id = i.queue_id
              where v_me.admin or pgque._may_see_queue(q, v_me.role, v_sends, v_consumes) loop
        if not v_me.admin then
            r.consumers := (select count(*) from pgque.subscription s
                              join pgque.queue q on q.queue_id = s.sub_queue
                             where s.sub_queue = r.queue_id
                               and pgque._may_use_consumer_name(q, s.sub_consumer, v_me.role));
        end if;
        if p_stalled_after is not null then
            r.stalled_after := p_stalled_after;
            r.stalled := pgque._queue_stalled(r.queue_id, r.last_tick_id, r.last_tick_age,
                                              p_stalled_after);
        end if;
        return next r;
    end loop;
end
$$;

-- pgque.get_consumer_info(): the rows of pgque.consumer_info.
create or replace function pgque.get_consumer_info()
returns setof pgque._consumer_info
language sql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select i.* from pgque._consumer_info i
      join pgque.queue q on q.queue_name = i.queue_name
     cross join pgque._caller_access() me
     where me.admin or pgque._may_use_consumer_name(q, i.consumer_name, me.role)
$$;

-- pgque.queue_info / pgque.consumer_info: what operators query.
create or replace view pgque.queue_info as select * from pgque.get_queue_info();
create or replace view pgque.consumer_info as select * from pgque.get_consumer_info();

-- pgque.get_partition_slot_status(stalled_after): the rows of
-- pgque.partition_slot_status (of the groups the caller may use, for one
-- that is not an admin), with stalled judged against stalled_after when given
-- (else each queue's own, _stalled_after; 22023 when negative).
create or replace function pgque.get_partition_slot_status(p_stalled_after interval default null)
returns setof pgque._partition_slot_status
language plpgsql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    r pgque._partition_slot_status;
begin
    perform pgque._check_stalled_after(p_stalled_after);
    for r in select i.* from pgque._partition_slot_status i
               join pgque.queue q on q.queue_name = i.queue_name
              cross join pgque._caller_access() me
              -- consumer_name is the group's: '#' makes _may_use_consumer_name judge the group.
              where me.admin or pgque._may_use_consumer_name(q, i.consumer_name || '#', me.role)
    loop
        if p_stalled_after is not null then
            r.stalled_after := p_stalled_after;
            r.stalled := pgque._slot_stalled(r.oldest_unconsumed_age, r.owner_pid,
                                             r.last_active, p_stalled_after);
        end if;
        return next r;
    end loop;
end
$$;

create or replace view pgque.partition_slot_status as
select * from pgque.get_partition_slot_status();

-- pgque.get_group_info(): the rows of pgque.group_info: the consumer groups
-- the caller may use (all of them for an admin).
create or replace function pgque.get_group_info()
returns setof pgque._group_info
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select pg_stat_clear_snapshot();  -- sessions that started since the transaction did
    select i.* from pgque._group_info i
      join pgque.queue q on q.queue_name = i.queue_name
     cross join pgque._caller_access() me
     where me.admin or pgque._may_use_consumer_name(q, i.consumer_name || '#', me.role)
$$;

create or replace view pgque.group_info as select * from pgque.get_group_info();

-- pgque.get_ticker_info(): the row of pgque.ticker_info: the database's
-- active ticker (active_ticker(): only sessions that may tick count), by
-- backend pid and the application name its session set; nulls when none is
-- active. Who ticks is no secret (pg_stat_activity shows every session), so
-- every reader may see it: when nothing ticks, nothing is delivered.
create or replace function pgque.get_ticker_info(out active_pid integer, out active_name text)
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select t.pid, nullif(a.application_name, '')
      from (select pgque.active_ticker() as pid) t
      left join pg_stat_activity a on a.pid = t.pid
$$;

create or replace view pgque.ticker_info as select * from pgque.get_ticker_info();

-- pgque.get_generated_code(): the rows of pgque.generated_code: every piece
-- of generated code (code/generated/generator.sql) with whether it is current
-- (false: it lags, and what it serves runs the slower dynamic way until
-- maintenance writes it). A caller that is not an admin sees the event writer
-- and the code of the queues it may see (those queue_info shows it).
create or replace function pgque.get_generated_code(
    out kind text, out queue_name text, out name text, out current boolean)
returns setof record
language sql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    -- Who the caller is and what it may do at all, judged once, not per row.
    with me as materialized (
        select c.admin, c.role, pgque._may_send_at_all(c.role) as sends,
               pgque._may_consume_at_all(c.role) as consumes
          from pgque._caller_access() c)
    select g.kind, q.queue_name, g.name, g.current
      from pgque._generated_code() g
      left join pgque.queue q on q.queue_id = g.queue_id
     cross join me
     where g.queue_id is null or me.admin
        or pgque._may_see_queue(q, me.role, me.sends, me.consumes)
     order by g.queue_id nulls first, g.kind
$$;

create or replace view pgque.generated_code as select * from pgque.get_generated_code();

-- ===== code/info/keys.sql =====
-- pgque: lag per key: which keys of a consumer group have the most events
-- waiting, and since when (issue 29's hot keys).

-- pgque.key_lag(queue, consumer, top): the top keys of group consumer by
-- pending events (those its slots have not consumed: not visible in the
-- snapshot of the slot's last finished tick, the slot's open batch
-- included, and its retries moved back into the log), each with its slot,
-- how many and the oldest one's ev_time; most pending first, then oldest
-- first. A null key is the events sent without one (slot 0). One read of the
-- queue's events from the lowest xmin of the slots' last ticks up, by the
-- ev_txid index: the pending window, not the log. PQ001, PQ002, PQ014,
-- PQ015 as for a receive; 22023 for a top below 1 or above 10,000.
create or replace function pgque.key_lag(p_queue text, p_consumer text, p_top integer default 10)
returns table (partition_key text, slot integer, pending bigint, oldest timestamptz)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_at record;
begin
    if p_top is null or p_top < 1 or p_top > 10000 then
        raise exception using errcode = '22023',
            message = format('key_lag: top must be from 1 to 10000, not %s', p_top);
    end if;
    v_group := pgque._group(v_queue, p_consumer, null);
    v_at := pgque._group_positions(v_queue, v_group);
    if v_at.slots is null then
        return;
    end if;
    return query execute format(
        'select e.ev_extra1, o.k, count(*), min(e.ev_time)'
        '  from pgque.%I e'
        '  join unnest($2, $3, $4) as o(k, sub, snap)'
        '    on o.k = %2$s'
        ' where e.ev_txid >= $1'
        '   and not pg_visible_in_snapshot(e.ev_txid, o.snap)'
        '   and (e.ev_owner is null or e.ev_owner = o.sub)'
        ' group by e.ev_extra1, o.k'
        ' order by count(*) desc, min(e.ev_time), e.ev_extra1 nulls first'
        ' limit $5',
        pgque._event_table(v_queue.queue_id), pgque._slot_expr(v_group.cg_slots))
    using v_at.floor, v_at.slots, v_at.subs, v_at.snaps, p_top;
end
$$;

-- ===== code/info/metrics.sql =====
-- pgque: metrics for a monitoring system (issue 29): every figure of the
-- queues, plain consumers, consumer groups and slots the caller may see, in
-- one call, as rows that `pgque exporter` (pgque/exporter.py) serves in
-- Prometheus' text format.
--
-- pgque.metrics() returns (metric, labels, value): the metric's Prometheus
-- name, its labels as Prometheus writes them (name="value" pairs joined by
-- commas, values escaped: queue="orders",group="charge",slot="3"; empty for
-- none; every row of a metric has the same names in the same order) and the
-- value, so that a sample's line is metric{labels} value. (An array of names
-- and values took twice as long for the exporter to fetch: 1,600 slots make
-- some 16,000 rows.) A figure that does not exist (a slot that never had an
-- epoch, a queue without ticks) has no row. The metrics, by their labels:
--
--   no labels
--     pgque_active_ticker               1 when a ticker holds the election
--                                       (active_ticker()), else 0
--     pgque_newest_tick_age_seconds     age of the newest tick of any queue
--                                       shown (a running ticker keeps it
--                                       below the longest ticker_idle_period)
--   pid, name
--     pgque_active_ticker_info          1: the active ticker's backend pid and
--                                       the application name its session set
--                                       (its pid when it set none)
--   queue
--     pgque_queue_events_total          positions taken from the queue's event
--                                       sequence: every event sent, a send
--                                       that rolled back too, a delayed event
--                                       when sent and again when it enters the
--                                       log, one more per maintenance pass
--                                       that moved retries back (a counter:
--                                       rate() is events/s; 0 before the
--                                       first send)
--     pgque_queue_events_since_last_tick  of those, the positions taken since
--                                       the newest tick (not ticked yet)
--     pgque_queue_last_tick_age_seconds  age of the queue's newest tick
--     pgque_queue_stalled               1 when committed events wait for a tick
--                                       that nobody makes (queue_info.stalled)
--     pgque_queue_stalled_after_seconds  the queue's stall threshold
--     pgque_queue_current_table         the event table written now (0 to
--                                       event_tables - 1)
--     pgque_queue_rotation_age_seconds  time since the queue last switched
--                                       tables (queue_info.last_rotation)
--     pgque_queue_rotation_period_seconds  the queue's rotation_period
--   queue, table
--     pgque_queue_table_size_bytes      estimated size of event table n:
--                                       pg_class.relpages as its last vacuum,
--                                       analyze or truncate left it (read from
--                                       the catalog, so no lock is taken: a
--                                       size function would lock the table)
--   queue, consumer (plain consumers), and queue, group, slot (the slots of
--   consumer groups), as pgque_consumer_<name> and pgque_slot_<name>:
--     _behind_events                    positions of the queue's event
--                                       sequence after the subscription's
--                                       last finished tick: the events of
--                                       every key sent since (not only the
--                                       slot's: that needs a read of the
--                                       events, pgque.key_lag), its open batch
--                                       included, rolled-back sends too
--     _lag_seconds                      age of the first tick after the last
--                                       finished one: every event it covers
--                                       has waited at least this long; 0 when
--                                       the subscription is at the newest tick
--     _ticks_behind                     ticks of the queue after the last
--                                       finished one, counted up to 100 (a
--                                       subscription further behind shows 100:
--                                       its lag and backlog say how far)
--     _last_active_age_seconds          time since its last receive or ack
--     _retries_waiting                  its nacked events not back in the log
--     _dead_letters                     its dead letters
--     _stalled                          1 when its lag exceeds the queue's
--                                       threshold and it has not moved for as
--                                       long, or (a slot) nobody owns it:
--                                       unlike pgque status, also when the
--                                       ticks waiting hold no event of the
--                                       slot's keys, since an unread slot holds
--                                       back rotation all the same
--   queue, group, slot (slots only)
--     pgque_slot_owned                  1 when a session the group counts holds
--                                       the slot's lock, else 0
--     pgque_slot_epoch                  the slot's current fencing epoch (no
--                                       row before its first receive)
--     pgque_slot_blocked_keys           keys the pause policy blocks
--     pgque_slot_oldest_blocked_age_seconds  how long the oldest blocked key
--                                       has waited (no row when none)
--   queue, group, slot, owner, pid
--     pgque_slot_owner_info             1 per owned slot: the owner's
--                                       application name (its pid when it set
--                                       none) and backend pid
--   queue, group
--     pgque_group_slots                 the group's slot count
--     pgque_group_members               its live members (join_group)
--
-- Cost. The info views count each slot's pending events in the event tables
-- (about 0.6 ms a slot), too slow to scrape a hundred queues of sixteen slots
-- every few seconds. metrics() reads no event table (but for _queue_stalled's
-- index probe of a queue whose newest tick is older than its threshold): a
-- subscription's figures come from its newest cursor row, the ticks and the
-- queue's sequence. The ticks are read at most 100 a queue for ticks_behind
-- and looked up once per distinct position (the slots of an idle group share
-- one), pg_locks and pg_stat_activity once, the retries and blocked keys in
-- one aggregate each, the dead letters by index (a count: proportional to the
-- dead letters kept). At 100 queues of 16 slots under load a call took 32 ms
-- (median) with the fetch of its 15,800 rows: docs/benchmarks.md, suite
-- exporter.
--
-- Access, as the info views: a caller that is not an admin sees the queues it
-- may send to or consume from, and the consumers and groups of those it may
-- use; only sessions whose role may use a group count as its owners and
-- members. Locks: it reads, locking nothing that a producer or a worker waits
-- for (no row locks; size functions are not called), and waits at most
-- 100 ms for a lock (a rotation's truncate, a drop_queue, an install hold
-- theirs until they commit), then fails with 55P03 rather than hang a scrape;
-- a queue's sequence and stall probe, held by a drop_queue, answer 0 instead.

-- pgque._label(name, value): one label as the text format writes it,
-- name="value", with backslashes, double quotes and newlines in value
-- escaped (names of queues and consumers have none, application names may
-- have the first two); a null value as empty. E'' strings: the same whatever
-- standard_conforming_strings says.
create or replace function pgque._label(p_name text, p_value text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select p_name || '="'
           || replace(replace(replace(coalesce(p_value, ''), E'\\', E'\\\\'),
                              '"', E'\\"'),
                      E'\n', E'\\n')
           || '"'
$$;

-- pgque.metrics(): the rows described above.
create or replace function pgque.metrics()
returns table (metric text, labels text, value double precision)
language plpgsql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
set lock_timeout = '100ms'
as $$
#variable_conflict use_column
declare
    v_me record;
    v_sends boolean := false;
    v_consumes boolean := false;
    v_parts record;
    v_ticker integer;
    v_ticker_name text;
begin
    perform pg_stat_clear_snapshot();  -- sessions that started since the transaction did
    select * into v_me from pgque._caller_access();
    if not v_me.admin then
        v_sends := pgque._may_send_at_all(v_me.role);
        v_consumes := pgque._may_consume_at_all(v_me.role);
    end if;
    v_parts := pgque._cursor_parts();
    v_ticker := pgque.active_ticker();
    v_ticker_name := (select coalesce(nullif(a.application_name, ''), v_ticker::text)
                        from pg_stat_activity a where a.pid = v_ticker);
    return query
    with queues as materialized (
        -- The queues the caller may see, with their newest tick and sequence.
        select q as qrow, q.queue_id, pgque._label('queue', q.queue_name) as queue_label,
               q.queue_ntables, q.queue_cur_table,
               q.queue_switch_time, q.queue_rotation_period,
               pgque._stalled_after(q) as stalled_after,
               t.tick_id, t.tick_time, t.tick_event_seq,
               -- null, and no row of the queue's that needs it, when it cannot be
               -- read (a drop_queue holds it): a counter that read 0 would look
               -- reset to Prometheus, and rate() would count the whole sequence.
               pgque._sequence_value(q.queue_event_seq) as seq
          from pgque.queue q
          left join lateral (select t.tick_id, t.tick_time, t.tick_event_seq
                               from pgque.tick t where t.tick_queue = q.queue_id
                              order by t.tick_id desc limit 1) t on true
         where v_me.admin or pgque._may_see_queue(q, v_me.role, v_sends, v_consumes)),
    groups as materialized (
        -- Access is judged once per group, not per slot.
        select q.qrow, q.queue_id, q.seq, q.stalled_after,
               q.queue_label || ',' || pgque._label('group', g.cg_consumer) as group_label,
               g.cg_id, g.cg_consumer, g.cg_slots, g.cg_owner, g.cg_grantees,
               pgque._member_class(g)::oid as member_class
          from queues q
          join pgque.consumer_group g on g.cg_queue = q.queue_id
         where v_me.admin or pgque._may_consume(v_me.role, q.qrow, g.cg_owner, g.cg_grantees)),
    subs as materialized (
        -- The slots of those groups, then the plain consumers the caller may use.
        select g.qrow, g.queue_id, g.seq, g.stalled_after,
               g.group_label || ',slot="' || k.slot::text || '"' as labels,
               k.slot, s.sub_id, s.sub_lock_key, g.cg_owner as owner, g.cg_grantees as grantees
          from groups g
         cross join lateral generate_series(0, g.cg_slots - 1) k(slot)
          -- _slot_name, written out (as in _group_subs)
          join pgque.subscription s
            on s.sub_queue = g.queue_id
           and s.sub_consumer = g.cg_consumer || '#' || k.slot::text || '/' || g.cg_slots::text
        union all
        select q.qrow, q.queue_id, q.seq, q.stalled_after,
               q.queue_label || ',' || pgque._label('consumer', s.sub_consumer),
               null, s.sub_id, null, s.sub_owner, s.sub_grantees
          from queues q
          join pgque.subscription s on s.sub_queue = q.queue_id
         where position('#' in s.sub_consumer) = 0
           and (v_me.admin or pgque._may_consume(v_me.role, q.qrow, s.sub_owner, s.sub_grantees))),
    cursors as materialized (
        -- pgque._current_cursor, written out (as in _slot_subs): a call per
        -- subscription cost more than its read. No row when a rotation
        -- emptied its partition after this statement's snapshot.
        select s.*, coalesce(c1.cur_last_tick, c2.cur_last_tick) as last_tick,
               coalesce(c1.cur_time, c2.cur_time) as last_active
          from subs s
          left join lateral (select o.cur_last_tick, o.cur_time from pgque.cursor o
                              where o.cur_part = v_parts.part and o.cur_sub = s.sub_id
                              order by o.cur_seq desc limit 1) c1 on true
          left join lateral (select o.cur_last_tick, o.cur_time from pgque.cursor o
                              where c1.cur_last_tick is null and o.cur_part = v_parts.moved_from
                                and o.cur_sub = s.sub_id
                              order by o.cur_seq desc limit 1) c2 on true),
    heads as materialized (
        -- Per queue, its newest ticks after its oldest position, at most 100,
        -- as an ascending array of their ids negated (read backwards along the
        -- index, so no sort): a position's ticks_behind is how many lie above
        -- it, which width_bucket finds by a binary search. So counting reads
        -- at most 100 ticks a queue, however many positions it has. (Ticks of
        -- a hundred queues lie on as many pages, and the pages written lately
        -- are not all-visible yet: each one read costs a heap fetch. Up to
        -- 1000 a queue, 98 queues far behind took 50 ms before a vacuum.)
        select p.queue_id,
               array(select -n.tick_id from pgque.tick n
                      where n.tick_queue = p.queue_id and n.tick_id > p.oldest
                      order by n.tick_id desc limit 100) as ids
          from (select c.queue_id, min(c.last_tick) as oldest from cursors c
                 group by c.queue_id) p),
    positions as materialized (
        -- Each distinct position once, by index: the sequence at its tick and
        -- the time of the first tick after it.
        select p.queue_id, p.last_tick,
               (select t.tick_event_seq from pgque.tick t
                 where t.tick_queue = p.queue_id and t.tick_id = p.last_tick) as seq_at,
               width_bucket(-p.last_tick - 1, h.ids) as ticks_behind,  -- -id < -last_tick
               (select n.tick_time from pgque.tick n
                 where n.tick_queue = p.queue_id and n.tick_id > p.last_tick
                 order by n.tick_id limit 1) as next_tick_time
          from (select distinct c.queue_id, c.last_tick from cursors c
                 where c.last_tick is not null) p
          join heads h on h.queue_id = p.queue_id),
    locks as materialized (
        -- Advisory locks are per database, but pg_locks shows the whole cluster.
        select l.classid, l.objid, l.objsubid, l.pid, a.usesysid as role,
               coalesce(nullif(a.application_name, ''), l.pid::text) as name
          from pg_locks l
          left join pg_stat_activity a on a.pid = l.pid
         where l.locktype = 'advisory' and l.granted and l.mode = 'ExclusiveLock'
           and l.database = (select d.oid from pg_database d where d.datname = current_database())),
    owners as materialized (
        -- The session holding a slot's key, if its role may use the group.
        select distinct on (s.sub_id) s.sub_id, k.pid,
               pgque._label('owner', k.name) || ',pid="' || k.pid::text || '"' as label
          from subs s
          join locks k
            on k.objsubid = 1
           and k.classid = ((s.sub_lock_key >> 32) & 4294967295)::oid
           and k.objid = (s.sub_lock_key & 4294967295)::oid
         where pgque._may_consume(k.role, s.qrow, s.owner, s.grantees)
         order by s.sub_id, k.pid),
    members as materialized (
        select g.cg_id, count(distinct k.pid) as n
          from groups g
          join locks k on k.objsubid = 2 and k.classid = g.member_class
         where pgque._may_consume(k.role, g.qrow, g.cg_owner, g.cg_grantees)
         group by g.cg_id),
    retries as materialized (
        select r.ev_owner as sub_id, count(*) as n from pgque._retry_waiting r group by r.ev_owner),
    blocked as materialized (
        select b.bk_sub as sub_id, count(*) as n, min(b.bk_since) as since
          from pgque.blocked_key b group by b.bk_sub),
    figures as (
        -- One row per subscription with all its figures.
        select c.labels, c.slot,
               case when c.slot is null then 'pgque_consumer_' else 'pgque_slot_' end as prefix,
               -- In double precision from here on (date_part, not extract):
               -- numeric arithmetic on every value cost a tenth of the call.
               (c.seq - least(p.seq_at, c.seq))::float8 as behind,  -- (null with seq)
               case when c.last_tick is not null
                    then coalesce(date_part('epoch', now() - p.next_tick_time), 0) end as lag,
               p.ticks_behind::float8 as ticks_behind,
               date_part('epoch', now() - c.last_active) as idle,
               coalesce(r.n, 0)::float8 as retries,
               (select count(*) from pgque.dead_letter d where d.dl_sub = c.sub_id)::float8
                   as dead,
               o.pid as owner_pid, o.label as owner_label,
               e.sc_epoch::float8 as epoch,
               coalesce(b.n, 0)::float8 as blocked,
               date_part('epoch', now() - b.since) as blocked_age,
               coalesce(now() - p.next_tick_time > c.stalled_after
                        and ((c.slot is not null and o.pid is null)
                             or now() - c.last_active > c.stalled_after), false) as stalled
          from cursors c
          left join positions p on p.queue_id = c.queue_id and p.last_tick = c.last_tick
          left join owners o on o.sub_id = c.sub_id
          left join retries r on r.sub_id = c.sub_id
          left join blocked b on b.sub_id = c.sub_id
          left join pgque.slot_claim e on c.slot is not null and e.sc_sub = c.sub_id)
    -- The ticker.
    select 'pgque_active_ticker', '', (v_ticker is not null)::integer::float8
    union all
    select 'pgque_active_ticker_info',
           'pid="' || v_ticker::text || '",' || pgque._label('name', v_ticker_name), 1
     where v_ticker is not null
    union all
    select 'pgque_newest_tick_age_seconds', '',
           date_part('epoch', now() - max(q.tick_time))
      from queues q
    having max(q.tick_time) is not null
    union all
    -- The queues.
    select m.metric, q.queue_label, m.value
      from queues q
     cross join lateral (values
         ('pgque_queue_events_total', q.seq::float8),
         ('pgque_queue_events_since_last_tick',
          (q.seq - least(coalesce(q.tick_event_seq, 0), q.seq))::float8),
         ('pgque_queue_last_tick_age_seconds', date_part('epoch', now() - q.tick_time)),
         ('pgque_queue_stalled',
          pgque._queue_stalled(q.queue_id, q.tick_id, now() - q.tick_time,
                               q.stalled_after)::integer::float8),
         ('pgque_queue_stalled_after_seconds', date_part('epoch', q.stalled_after)),
         ('pgque_queue_current_table', q.queue_cur_table::float8),
         ('pgque_queue_rotation_age_seconds', date_part('epoch', now() - q.queue_switch_time)),
         ('pgque_queue_rotation_period_seconds', date_part('epoch', q.queue_rotation_period))
     ) m(metric, value)
     where m.value is not null
    union all
    select 'pgque_queue_table_size_bytes', q.queue_label || ',table="' || n::text || '"',
           greatest(c.relpages, 0)::float8 * current_setting('block_size')::float8
      from queues q
     cross join lateral generate_series(0, q.queue_ntables - 1) n
      -- _event_table, written out; the catalog's unique (relname, relnamespace).
      join pg_class c
        on c.relnamespace = 'pgque'::regnamespace
       and c.relname = 'event_' || q.queue_id::text || '_' || n::text
    union all
    -- The consumer groups.
    select m.metric, g.group_label, m.value
      from groups g
      left join members n on n.cg_id = g.cg_id
     cross join lateral (values ('pgque_group_slots', g.cg_slots::float8),
                                ('pgque_group_members', coalesce(n.n, 0)::float8)
     ) m(metric, value)
    union all
    -- Plain consumers and slots.
    select f.prefix || m.metric, f.labels, m.value
      from figures f
     cross join lateral (values
         ('behind_events', f.behind),
         ('lag_seconds', f.lag),
         ('ticks_behind', f.ticks_behind),
         ('last_active_age_seconds', f.idle),
         ('retries_waiting', f.retries),
         ('dead_letters', f.dead),
         ('stalled', f.stalled::integer::float8),
         ('owned', case when f.slot is not null then (f.owner_pid is not null)::integer end),
         ('epoch', f.epoch),
         ('blocked_keys', case when f.slot is not null then f.blocked end),
         ('oldest_blocked_age_seconds', f.blocked_age)
     ) m(metric, value)
     where m.value is not null
    union all
    select 'pgque_slot_owner_info', f.labels || ',' || f.owner_label, 1
      from figures f
     where f.owner_pid is not null;
end
$$;

-- ===== code/info/skew.sql =====
-- pgque: how evenly a consumer group's keys spread over its slots (issue
-- 29's skew report): whether N and the keys sent make every slot share the
-- work, or a few keys (or a few slots) take most of it.

-- pgque.slot_skew(queue, consumer, window): per slot of group consumer
-- (every slot, ascending, those without events too): the events sent to the
-- queue in the last window that route to it (pgque.slot_of over their keys),
-- the distinct keys among them (events without a key count as one key, of
-- slot 0), its share of the window's events and its load, events over the
-- mean per slot (1: an even share; the largest load is the max/mean ratio of
-- the group; null when the window has no events); and since, when the window
-- measured starts (the same on every row).
--
-- Events sent: the queue's events visible now (committed) whose transaction
-- started (ev_time) at or after the window's start, not counting retries
-- moved back into the log, which are delivered again, not sent.
--
-- Cost: one read of the window's events, by the ev_txid index, not of the
-- log: those of the transactions that the snapshot of the queue's newest
-- tick made at or before the window's start does not see (a tick's time is
-- taken after its snapshot, so a transaction that started later took its id
-- at or above the snapshot's xmax, or was running then, in its list), as a
-- batch is read. Measured once by hand (one core, 16 slots, 10,000 keys):
-- 1,000,000 events in the window took 0.11 s (0.31 s at the first read of
-- fresh rows, which sets their hint bits); 10,000 in the window of a queue
-- holding 1,000,000 more from before it, 5 ms. The window reaches no
-- further back than the queue's oldest tick, which maintenance keeps for a
-- minute or more (ticks rotate about once a minute, ticker/rotation.sql):
-- when that tick is younger than the window, the window starts there, as
-- since says.
--
-- Raises PQ001 (unknown queue), PQ002 (unknown group), PQ014 and PQ015 as
-- for a receive, and 22023 for a window that is null or not positive.
create or replace function pgque.slot_skew(p_queue text, p_consumer text,
                                           p_window interval default '1 minute')
returns table (slot integer, events bigint, keys bigint, share double precision,
               load double precision, since timestamptz)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
set lock_timeout = '100ms'  -- not behind a drop_queue or an install: 55P03 instead
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_start timestamptz;
    v_since timestamptz;
    v_floor xid8;
    v_running xid8[];
begin
    if p_window is null or p_window <= interval '0' then
        raise exception using errcode = '22023',
            message = format('slot_skew: window must be positive, not %s',
                             coalesce(p_window::text, 'null'));
    end if;
    v_group := pgque._group(v_queue, p_consumer, null);
    -- (No log is older than a thousand years: a longer window is that one,
    -- not a timestamp out of range.)
    v_start := now() - least(p_window, interval '1000 years');
    -- A tick's time is taken after its snapshot (log/tick.sql): a transaction
    -- that started after that time took its id at or above the snapshot's
    -- xmax, or before the snapshot, and then it was running (a tick's move of
    -- delayed events, whose ev_time is the tick's, in a ticker transaction
    -- that ticked another queue first).
    select t.tick_time, pg_snapshot_xmax(t.tick_snapshot),
           array(select pg_snapshot_xip(t.tick_snapshot))
      into v_since, v_floor, v_running
      from pgque.tick t
     where t.tick_queue = v_queue.queue_id and t.tick_time <= v_start
     order by t.tick_id desc limit 1;
    if found then
        v_since := v_start;
    else
        -- No tick is that old any more: the window starts at the oldest one.
        select t.tick_time, pg_snapshot_xmax(t.tick_snapshot),
               array(select pg_snapshot_xip(t.tick_snapshot))
          into v_since, v_floor, v_running
          from pgque.tick t
         where t.tick_queue = v_queue.queue_id
         order by t.tick_id limit 1;
    end if;
    return query execute format(
        'with counted as ('
        '    select %s as k, e.ev_extra1 as key, count(*) as n'
        '      from pgque.%I e'
        '     where (e.ev_txid >= $1 or e.ev_txid = any($4))'
        '       and e.ev_time >= $2 and e.ev_owner is null'
        '     group by 1, 2),'
        ' per_slot as ('
        '    select c.k, sum(c.n)::bigint as n, count(*) as keys from counted c group by c.k),'
        ' total as (select sum(p.n) as n from per_slot p)'
        ' select s.k, coalesce(p.n, 0), coalesce(p.keys, 0),'
        '        coalesce(p.n, 0)::float8 / nullif(t.n, 0)::float8,'
        '        coalesce(p.n, 0)::float8 * $3 / nullif(t.n, 0)::float8, $2'
        '   from generate_series(0, $3 - 1) s(k)'
        '   left join per_slot p on p.k = s.k'
        '  cross join total t'
        '  order by s.k',
        pgque._slot_expr(v_group.cg_slots), pgque._event_table(v_queue.queue_id))
    using v_floor, v_since, v_group.cg_slots, v_running;
end
$$;

-- ===== code/info/verify.sql =====
-- pgque: checking a group's record of handler calls (slots/handling.sql)
-- against what pgque promises: `pgque verify`.
--
-- What is checked, for the calls that started since the group's recording
-- began (or since a time the caller gives):
--
-- * routing (G1): every call of a key ran in the slot the key routes to;
-- * per-key order: the first calls of a key's events (retry count 0) came in
--   delivery order (docs/guarantees.md, per-key order): no event first handled
--   after an event of its key with a larger id from the same batch or a later
--   one. (An event of a later batch with a smaller id may come after:
--   its transaction committed later, or it was held under the pause policy,
--   whose pieces take a batch id when first handed out and keep it when
--   handed out again.) Calls less than clock_skew apart are not judged.
--   Under the pause policy, the events of a key delivered after one that
--   failed (by batch, then id) that started after the failure and before the
--   failed event's next call or its dead letter are reported, not as
--   violations: an operator's resume_key, skip_head, or a dead letter
--   replayed or purged releases the key, and the record does not hold those;
-- * one handler per key at a time: no two calls of a key overlap in time. An
--   overlap where the earlier call ran under an older epoch than the later
--   (the previous owner's call in flight when its slot moved, docs/guarantees.md
--   "What is not guaranteed") is reported as a zombie window, not a violation;
--   calls more than clock_skew apart only count, for workers whose clocks differ;
-- * nothing lost: every event sent since then (as far as the event tables
--   still hold it) that a slot's cursor has passed has a call that returned,
--   a call that dead-lettered it, a dead letter, or a retry or held copy still
--   to come.
--
-- The cost is a read of the calls and of the event tables since the start;
-- a validation tool, not a hot path.

-- pgque._recorded_group(queue, consumer, since): the group (checked as a
-- receive checks it, without a slot count) and the start of the window: the
-- group's recording start, or since when that is later; PQ033 for a group
-- that has no recording start (none of its workers recorded since its record
-- was last forgotten), whatever since.
create or replace function pgque._recorded_group(
    p_queue pgque.queue, p_consumer text, p_since timestamptz,
    out grp pgque.consumer_group, out since timestamptz)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    grp := pgque._group(p_queue, p_consumer, null);
    since := greatest(p_since, grp.cg_recorded_since);  -- (greatest ignores a null)
    if grp.cg_recorded_since is null then
        raise exception using errcode = 'PQ033',
            message = format('consumer group %L of queue %L has no record of handler calls',
                             pgque._name_for_message(p_consumer), p_queue.queue_name),
            hint = 'Run its workers with record=True (pgque worker --record), then verify.';
    end if;
end
$$;

-- pgque.handling_summary(queue, consumer, since): what the group's record
-- holds since since (default: its recording start): the start used, how many
-- calls, of how many events and keys, by how many workers, the first call's
-- start and the last call's end. PQ033 as for verify_handling.
create or replace function pgque.handling_summary(
    p_queue text, p_consumer text, p_since timestamptz default null,
    out since timestamptz, out calls bigint, out events bigint, out keys bigint,
    out workers bigint, out first_call timestamptz, out last_call timestamptz)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_group record := pgque._recorded_group(pgque._queue_row(p_queue), p_consumer, p_since);
begin
    since := v_group.since;
    select count(*), count(distinct (h.hd_sub, h.hd_ev_id)), count(distinct h.hd_key),
           count(distinct h.hd_worker), min(h.hd_started), max(h.hd_ended)
      into calls, events, keys, workers, first_call, last_call
      from pgque._group_subs(v_group.grp) g
      join pgque.handling h on h.hd_sub = g.sub_id
     where h.hd_started >= since;
end
$$;

-- pgque.verify_handling(queue, consumer, since, clock_skew): the findings of
-- the checks above on the group's record since since (default: its recording
-- start, or since when that is later), ordered by time. kind is 'misrouted',
-- 'reorder', 'paused', 'overlap', 'zombie_window' or 'lost'; violation is
-- false for a zombie window, a call while its key was paused, and under the
-- pause policy for a reorder. slot, partition_key and ev_id name the call or event found, other_ev_id
-- the other event involved (the one it came after, overlapped or was held
-- behind), at the time of the finding, detail says it in words. No row: the
-- record shows nothing wrong. PQ033 for a group without a record; PQ001,
-- PQ002, PQ014, PQ015 as for a receive; 22023 for a negative clock_skew.
create or replace function pgque.verify_handling(
    p_queue text, p_consumer text, p_since timestamptz default null,
    p_clock_skew interval default interval '0')
returns table (kind text, violation boolean, slot integer, partition_key text, ev_id bigint,
               other_ev_id bigint, at timestamptz, detail text)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_recorded record;
    v_group pgque.consumer_group;
    v_since timestamptz;
    v_at record;
begin
    if p_clock_skew is null or p_clock_skew < interval '0' then
        raise exception using errcode = '22023',
            message = 'verify_handling: clock_skew must not be negative';
    end if;
    v_recorded := pgque._recorded_group(v_queue, p_consumer, p_since);
    v_group := v_recorded.grp;
    v_since := v_recorded.since;

    return query
    with calls as materialized (
        select g.slot, h.*,
               row_number() over (order by h.hd_started, h.hd_sub, h.hd_ev_id) as n,
               -- the next call of the same event, if any
               lead(h.hd_started) over (partition by h.hd_sub, h.hd_ev_id
                                        order by h.hd_started) as next_call
          from pgque._group_subs(v_group) g
          join pgque.handling h on h.hd_sub = g.sub_id
         where h.hd_started >= v_since
    ),
    -- G1: the key's slot.
    misrouted as (
        select 'misrouted'::text as kind, true as violation, c.slot, c.hd_key, c.hd_ev_id,
               null::bigint as other, c.hd_started as at,
               format('handled in slot %s; its key routes to slot %s of %s', c.slot,
                      pgque.slot_of(c.hd_key, v_group.cg_slots), v_group.cg_slots) as detail
          from calls c
         where pgque.slot_of(c.hd_key, v_group.cg_slots) <> c.slot
    ),
    -- Order: each event's first call (not a retry), in delivery order per key.
    firsts as (
        select distinct on (c.hd_sub, c.hd_ev_id) c.*
          from calls c
         where c.hd_retry = 0 and c.hd_key is not null
         order by c.hd_sub, c.hd_ev_id, c.hd_started, c.n
    ),
    firsts_in_turn as (
        select f.*, lag(f.hd_batch) over w as prev_batch, lag(f.hd_ev_id) over w as prev_ev,
               lag(f.hd_started) over w as prev_started
          from firsts f
        window w as (partition by f.hd_key order by f.hd_started, f.n)
    ),
    reorder as (
        -- (Under pause, not judged: held pieces take their batch ids when handed
        -- out, so a piece handed out again after a lost session, or the next
        -- held piece, can carry ids that do not follow delivery; seen in the
        -- demo's pause run with a session cut, whose own order check held.)
        select 'reorder'::text, v_group.cg_policy <> 'pause', f.slot, f.hd_key, f.hd_ev_id,
               f.prev_ev, f.hd_started,
               format('first handled after event %s of its key (batch %s), which comes '
                      'after it (this one is of batch %s)', f.prev_ev, f.prev_batch, f.hd_batch)
          from firsts_in_turn f
         where f.hd_ev_id < f.prev_ev and f.hd_batch <= f.prev_batch
           and f.hd_started > f.prev_started + p_clock_skew  -- (else the clocks may tell)
    ),
    -- One at a time: each call against the latest end of the key's calls that
    -- started before it.
    ends as (
        select c.*, max(c.hd_ended) over (partition by c.hd_key order by c.hd_started, c.n
                                          rows between unbounded preceding and 1 preceding)
                        as busy_until
          from calls c
         where c.hd_key is not null
    ),
    overlap as (
        select case when p.hd_epoch < e.hd_epoch then 'zombie_window' else 'overlap' end,
               not coalesce(p.hd_epoch < e.hd_epoch, false), e.slot, e.hd_key, e.hd_ev_id,
               p.hd_ev_id, e.hd_started,
               format('started by %s (epoch %s) while event %s of its key ran in %s (epoch %s) '
                      'for %s more', e.hd_worker, e.hd_epoch, p.hd_ev_id, p.hd_worker,
                      p.hd_epoch, e.busy_until - e.hd_started)
          from ends e
          cross join lateral (select p.* from calls p
                               where p.hd_key = e.hd_key and p.hd_ended = e.busy_until
                                 and p.n < e.n
                               order by p.n limit 1) p
         where e.busy_until - p_clock_skew > e.hd_started
    ),
    -- Pause: after a failure of an event, nothing delivered after it of its
    -- key until that event is called again or dead-lettered. (An event
    -- delivered before it may come again after it: a piece handed out again
    -- after its worker died.) Not a violation by itself: an operator's
    -- resume_key, skip_head, or a dead letter replayed or purged, releases
    -- the hold, and the record does not hold those.
    holds as (
        select f.*, least(f.next_call, d.dl_time) as until
          from calls f
          left join (select dl.dl_sub, dl.ev_id, min(dl.dl_time) as dl_time
                       from pgque.dead_letter dl
                      where dl.dl_sub = any(array(select g.sub_id
                                                    from pgque._group_subs(v_group) g))
                      group by dl.dl_sub, dl.ev_id) d
            on d.dl_sub = f.hd_sub and d.ev_id = f.hd_ev_id
         where v_group.cg_policy = 'pause' and f.hd_outcome = 'f' and f.hd_key is not null
    ),
    paused as (
        -- (Each call once, with the first hold it broke.)
        select distinct on (x.n)
               'paused'::text, false, x.slot, x.hd_key, x.hd_ev_id, f.hd_ev_id, x.hd_started,
               format('started while its key was paused behind event %s, which failed at %s '
                      '(a violation unless an operator released the key)',
                      f.hd_ev_id, f.hd_ended)
          from holds f
          join calls x
            on x.hd_key = f.hd_key and (x.hd_batch, x.hd_ev_id) > (f.hd_batch, f.hd_ev_id)
           and x.hd_started > f.hd_ended + p_clock_skew
           and (f.until is null or x.hd_started < f.until)
         order by x.n, f.hd_ended
    )
    select * from misrouted
    union all select * from reorder
    union all select * from overlap
    union all select * from paused
    order by 7, 5;

    -- Nothing lost: each slot's events that its cursor passed (visible in the
    -- snapshot of its last finished batch's tick), sent since the start.
    v_at := pgque._group_positions(v_queue, v_group);
    if v_at.slots is null then
        return;
    end if;
    return query execute format(
        'select ''lost''::text, true, o.k, e.ev_extra1, e.ev_id, null::bigint, e.ev_time,'
        '       ''its slot passed it, but no call returned, no dead letter or retry holds it'''
        '  from pgque.%1$I e'
        '  join unnest($2, $3, $4) as o(k, sub, snap)'
        '    on o.k = %2$s'
        ' where e.ev_owner is null and e.ev_time >= $1'
        '   and pg_visible_in_snapshot(e.ev_txid, o.snap)'
        '   and not exists (select from pgque.handling h'
        '                    where h.hd_sub = o.sub and h.hd_ev_id = e.ev_id'
        '                      and h.hd_outcome in (''o'', ''d''))'
        '   and not exists (select from pgque.dead_letter d'
        '                    where d.dl_sub = o.sub and d.ev_id = e.ev_id)'
        '   and not exists (select from pgque._retry_waiting r'
        '                    where r.ev_owner = o.sub and r.ev_id = e.ev_id)'
        '   and not exists (select from pgque.held_event x'
        '                     join pgque.blocked_key b'
        '                       on b.bk_sub = x.he_sub and b.bk_key = x.he_key'
        '                    where x.he_sub = o.sub and x.ev_id = e.ev_id'
        '                      and x.he_seq > b.bk_done_seq)'
        '   and not exists (select from pgque.%1$I x'
        '                    where x.ev_owner = o.sub and x.ev_id = e.ev_id'
        '                      and not pg_visible_in_snapshot(x.ev_txid, o.snap))'
        ' order by e.ev_time, e.ev_id',
        pgque._event_table(v_queue.queue_id), pgque._slot_expr(v_group.cg_slots))
    using v_since, v_at.slots, v_at.subs, v_at.snaps;
end
$$;

set local check_function_bodies = on;

-- ===== install/generated.sql =====
-- pgque: every piece of generated code written again from the current
-- templates, for the queues there are (see code/generated/generator.sql):
-- install/drop_code.sql dropped it with the rest of the code, under the
-- generators' lock, which this transaction still holds.

do $generated$
declare
    v_queue_id integer;
begin
    perform pgque._sync_event_writer(true);
    for v_queue_id in select q.queue_id from pgque.queue q order by q.queue_id loop
        perform pgque._sync_batch_reader(v_queue_id, true);
    end loop;
end
$generated$;

-- ===== install/grants.sql =====
-- pgque: privileges.
--
-- Callers never touch pgque's tables: they call functions that run as the
-- installer (SECURITY DEFINER, with search_path pinned to pg_catalog), and
-- read the info views. Execution is revoked from PUBLIC and granted by role:
--   pgque_writer  send events
--   pgque_reader  subscribe, receive, ack, nack, read the info views, list,
--                 replay and purge the dead letters of consumers it may use
--   pgque_admin   everything, including queue management and maintenance
-- Inside that bound, consumers belong to the roles that made them and queues
-- may be restricted per role (see base/access.sql).

revoke all on all routines in schema pgque from public;

-- Tables, sequences and views: revoked only where the ACL is still the default
-- (null) or names PUBLIC. Rewriting every table's catalog row on every run
-- would race maintenance's TRUNCATE and drop_queue, which update the same
-- rows ("tuple concurrently updated"); after its first install, a table is
-- left alone.
do $revoke$
declare
    v_relation text;
begin
    for v_relation in
        select case c.relkind when 'S' then 'sequence ' else 'table ' end
               || c.oid::pg_catalog.regclass::text
          from pg_catalog.pg_class c
         where c.relnamespace = 'pgque'::pg_catalog.regnamespace
           and c.relkind in ('r', 'p', 'S', 'v')
           and (c.relacl is null
                or exists (select 1 from pg_catalog.aclexplode(c.relacl) a where a.grantee = 0)) loop
        execute pg_catalog.format('revoke all on %s from public', v_relation);
    end loop;
end
$revoke$;

do $grants$
declare
    v_writer text[] := array[
        'send(text,text,text,text)', 'send(text,text,jsonb,text)',
        'send_batch(text,text[],text[],text[])',
        'send_with(text,text,text,text,timestamptz,interval,text)',
        'send_batch_with(text,text[],text[],text[],timestamptz[],interval[],text[])', 'version()',
        'pin_session(text)', 'session_checked(text,integer,text)'];
    v_reader text[] := array[
        'subscribe(text,text)', 'unsubscribe(text,text)', 'receive(text,text,integer)',
        'ack(text,text,bigint)', 'nack(text,text,bigint,bigint[],interval,text)',
        'ack(text,text,bigint,bigint[],text[],interval)',
        'pin_session(text)', 'session_checked(text,integer,text)',
        'queue_config(text)', 'dead_letters(text,text,integer,bigint)',
        'replay_dead_letter(text,bigint,boolean)',
        'replay_dead_letters(text,text,text,text,interval,text,boolean,boolean)',
        'purge_dead_letters_where(text,text,text,text,interval,text,boolean)', 'purge_dead_letters(text,text,bigint[])', 'version()',
        'get_queue_info(interval)', 'get_consumer_info()',
        'get_partition_slot_status(interval)', 'get_group_info()', 'get_ticker_info()',
        'get_generated_code()',
        'subscribe_slots(text,text,integer,text)', 'subscribe_slot(text,text,integer,integer)',
        'set_failure_policy(text,text,text,integer,interval,integer)', 'failure_policy(text,text)',
        'blocked_keys(text,text)', 'retry_head(text,text,text)',
        'skip_head(text,text,text,text)', 'resume_key(text,text,text)',
        'unsubscribe_slots(text,text)', 'slot_lock_key(text,text,integer)',
        'claim_slot(text,text,integer)', 'release_slot(text,text,integer)',
        'receive_partitioned(text,text,integer,integer,integer)',
        'ack_partitioned(text,text,integer,integer,bigint)',
        'ack_partitioned(text,text,integer,integer,bigint,bigint[],text[],interval)',
        'nack_partitioned(text,text,integer,integer,bigint,bigint[],interval,text)',
        'ack_receive_partitioned(text,text,integer,integer,bigint,bigint[],text[],interval,integer)',
        'ack_receive_partitioned(text,text,integer,integer,bigint,bigint[],text[],interval,interval[],bigint[],integer)',
        'ack_partitioned(text,text,integer,integer,bigint,bigint[],text[],interval,interval[],bigint[])',
        'ack(text,text,bigint,bigint[],text[],interval,interval[],bigint[])',
        'join_group(text,text)', 'group_status(text,text)', 'pending_slots(text,text)',
        'receive_slots(text,text,integer,integer[],integer)',
        'ack_slots(text,text,integer,integer[],bigint[])',
        'ack_receive_slots(text,text,integer,integer[],bigint[],integer[],integer)',
        'slot_of(text,integer)',
        'max_slots()', 'tick_channel(text)',
        'grant_consumer(text,text,text)', 'revoke_consumer(text,text,text)',
        'queue_grants(text)', 'check_fence(text,text,integer,bigint)',
        'start_recording(text,text,integer)',
        'record_handling(text,text,integer,text,jsonb)',
        'forget_handling(text,text,integer)', 'handling_summary(text,text,timestamptz)',
        'verify_handling(text,text,timestamptz,interval)', 'key_lag(text,text,integer)',
        'metrics()', 'slot_skew(text,text,interval)'];
    v_fn text;
begin
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_writer') then
        execute 'grant usage on schema pgque to pgque_writer';
        foreach v_fn in array v_writer loop
            execute pg_catalog.format('grant execute on function pgque.%s to pgque_writer', v_fn);
        end loop;
    end if;
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_reader') then
        execute 'grant usage on schema pgque to pgque_reader';
        foreach v_fn in array v_reader loop
            execute pg_catalog.format('grant execute on function pgque.%s to pgque_reader', v_fn);
        end loop;
        execute 'grant select on pgque.queue_info, pgque.consumer_info, '
                'pgque.partition_slot_status, pgque.group_info, pgque.ticker_info, '
                'pgque.generated_code to pgque_reader';
    end if;
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_admin') then
        execute 'grant usage on schema pgque to pgque_admin';
        -- Every public function; the internal ones (leading underscore) are
        -- reached only through them.
        for v_fn in select p.oid::regprocedure::text
                      from pg_catalog.pg_proc p
                     where p.pronamespace = 'pgque'::regnamespace and p.proname !~ '^_' loop
            execute pg_catalog.format('grant execute on routine %s to pgque_admin', v_fn);
        end loop;
        execute 'grant select on pgque.queue_info, pgque.consumer_info, '
                'pgque.partition_slot_status, pgque.group_info, pgque.ticker_info, '
                'pgque.generated_code to pgque_admin';
    end if;
end
$grants$;

-- ===== record the installed version =====
insert into pgque.installed (in_version) values ('0.13.0')
on conflict (in_single) do update set in_version = excluded.in_version;
