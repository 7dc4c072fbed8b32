-- Migration 13 (pgque 0.14.0): slot ownership by lease, for clients behind a
-- transaction-mode pooler (code/slots/lease.sql), the ticker election by
-- lease (code/ticker/election.sql), and the generation of fencing epochs
-- (code/slots/fence.sql).
--
-- A group owns its slots by session advisory locks (cg_lease null, the
-- default) or by leases of cg_lease each: rows with an expiry that their
-- holders renew. A lease is named by a random token that only its holder
-- knows; every call of the holder carries it. slot_claim.sc_lease names the
-- lease that owns the slot (its epoch taken when the lease claimed it); no
-- foreign key: maintenance deletes a lease once it has been expired a minute,
-- and a claim naming a lease that is gone names nobody.

alter table pgque.consumer_group
    add column if not exists cg_lease interval
        check (cg_lease is null or cg_lease between interval '1 second' and interval '1 hour');

create table if not exists pgque.lease (
    lease_id      bigint generated always as identity primary key,
    lease_token   text not null unique check (length(lease_token) between 32 and 64),
    lease_group   integer not null references pgque.consumer_group on delete cascade,
    lease_role    oid not null,       -- the login role that took it (session_user)
    lease_name    text not null check (length(lease_name) between 1 and 200),
    lease_member  boolean not null,   -- counts in the group's fair share (a Worker's control)
    lease_until   timestamptz not null,
    lease_created timestamptz not null default now()
);
create index if not exists lease_group_idx on pgque.lease (lease_group);

alter table pgque.slot_claim add column if not exists sc_lease bigint;

-- The ticker election by lease: the token and expiry of the ticker holding it
-- (null: none), beside the advisory key of the session-locked election.
alter table pgque.ticker_election
    add column if not exists te_lease_token text,
    add column if not exists te_lease_name text,
    add column if not exists te_lease_until timestamptz;

-- The generation of the fencing epochs (slots/fence.sql, _new_epoch): the
-- highest server timeline an epoch of this database was taken on. An epoch is
-- the generation times 2^40 plus the epoch sequence's value; the generation
-- follows the timeline up after a failover, and stays when a pg_upgrade or a
-- restore starts the server on timeline 1 again.
create table if not exists pgque.epoch_generation (
    eg_single     boolean primary key default true check (eg_single),
    eg_generation bigint not null
);
-- The timeline of the server it is installed on (a primary): so the first
-- epochs write nothing here (the workers' hot path updates no row).
insert into pgque.epoch_generation (eg_generation)
values (('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))
        ::bit(32)::bigint)
on conflict do nothing;
