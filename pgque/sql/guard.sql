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
