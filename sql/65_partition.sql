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
-- Errors: PQ020 slot count differs from the persisted one, PQ021 slot
-- subscription used through the plain API, PQ022 invalid slot count, PQ023
-- invalid slot number, PQ024 the session does not own the slot.

-- One row per consumer group: its persisted slot count.
create table if not exists pgque.consumer_group (
    cg_id       integer generated always as identity primary key,
    cg_queue    integer not null references pgque.queue on delete cascade,
    cg_consumer text not null,
    cg_slots    integer not null,
    cg_created  timestamptz not null default now(),
    unique (cg_queue, cg_consumer)
);

-- pgque.max_slots(): the largest slot count a group may have.
create or replace function pgque.max_slots()
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 1024 $$;

-- pgque._slot_lock_class(): high 32 bits of slot advisory-lock keys ('pgqs').
-- The low 32 bits are the slot subscription's sub_id, unique per database,
-- so slots of different queues and groups never share a key; another
-- application's bigint advisory locks meet ours only if their keys carry
-- this same high word.
create or replace function pgque._slot_lock_class()
returns bigint
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 1885827443::bigint $$;

-- pgque._group_lock_class(): high 32 bits of group-membership lock keys ('pgqg').
create or replace function pgque._group_lock_class()
returns bigint
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 1885827431::bigint $$;

-- pgque.slot_of(key, slots): the slot a partition key routes to. This is
-- the one definition of routing; the receive filter and the info functions
-- write the same formula inline, since a function with a pinned search_path
-- is never inlined and would cost a call per event row.
create or replace function pgque.slot_of(p_key text, p_slots integer)
returns integer
language sql immutable parallel safe
set search_path = pg_catalog, pg_temp
as $$
    select case when p_key is null then 0
                else ((hashtextextended(p_key, 0) % p_slots + p_slots) % p_slots)::integer end
$$;

-- pgque._slot_name(consumer, k, n): the slot subscription's consumer name.
create or replace function pgque._slot_name(p_consumer text, p_slot integer, p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select p_consumer || '#' || p_slot::text || '/' || p_slots::text $$;

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

-- pgque._group(queue, consumer, slots): the group row, checking that slots
-- equals its persisted count (PQ020); PQ002 when the group does not exist.
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

-- pgque._ensure_group(queue, consumer, slot, slots): validates the name, the
-- slot and the count, and registers the group with its count unless it exists
-- (PQ020 if it exists with another count).
create or replace function pgque._ensure_group(
    p_queue pgque.queue, p_consumer text, p_slot integer, p_slots integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pgque._check_name('consumer', p_consumer);
    perform pgque._check_slot(p_slot, p_slots);
    insert into pgque.consumer_group (cg_queue, cg_consumer, cg_slots)
    values (p_queue.queue_id, p_consumer, p_slots)
    on conflict (cg_queue, cg_consumer) do nothing;
    perform pgque._group(p_queue, p_consumer, p_slots);
end
$$;

-- pgque.subscribe_slots(queue, consumer, slots): subscribes consumer group
-- consumer with slots slots (all of them), persisting the count. Idempotent
-- for the same count; returns how many slot subscriptions were new. Raises
-- PQ020 if the group exists with another count, PQ022 for a bad count,
-- PQ004 for a bad name.
create or replace function pgque.subscribe_slots(p_queue text, p_consumer text, p_slots integer)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_new integer := 0;
    k integer;
begin
    perform pgque._ensure_group(v_queue, p_consumer, 0, p_slots);
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
-- many slot subscriptions were removed.
create or replace function pgque.unsubscribe_slots(p_queue text, p_consumer text)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
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

-- pgque._slot_sub(queue, consumer, slot, slots, lock): the slot's queue and
-- subscription rows and cursor, after validating slot and slots and the
-- persisted count.
create or replace function pgque._slot_sub(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_lock boolean,
    out queue pgque.queue, out sub pgque.subscription, out cur pgque.cursor)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    perform pgque._check_slot(p_slot, p_slots);
    perform pgque._group(pgque._queue_row(p_queue), p_consumer, p_slots);
    select * into v
      from pgque._find_subscription(p_queue, pgque._slot_name(p_consumer, p_slot, p_slots), p_lock);
    queue := v.queue;
    sub := v.sub;
    cur := v.cur;
end
$$;

-- pgque.slot_lock_key(queue, consumer, slot): the bigint key of the session
-- advisory lock that owns the slot. Every client derives it here.
create or replace function pgque.slot_lock_key(p_queue text, p_consumer text, p_slot integer)
returns bigint
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, v_group.cg_slots, false);
    return (pgque._slot_lock_class() << 32) | (v.sub).sub_id;
end
$$;

-- pgque._holds_lock(class, id, mode): whether this session holds the bigint
-- advisory lock (class << 32) | id in mode ('ExclusiveLock' or 'ShareLock').
-- Only an exclusive hold of a slot's key is ownership: any session may take
-- the key in share mode, and two of them would both pass a mode-blind check.
create or replace function pgque._holds_lock(p_class bigint, p_id integer, p_mode text)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (
        select 1 from pg_locks
         where locktype = 'advisory' and pid = pg_backend_pid() and granted
           and classid = p_class::oid and objid = p_id::oid and objsubid = 1
           and mode = p_mode)
$$;

-- pgque._holds_slot(sub_id): whether this session holds the slot's lock exclusively.
create or replace function pgque._holds_slot(p_sub_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select pgque._holds_lock(pgque._slot_lock_class(), p_sub_id, 'ExclusiveLock') $$;

-- pgque._require_owner(sub, slot): PQ024 unless this session holds the lock.
create or replace function pgque._require_owner(p_sub pgque.subscription)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._holds_slot(p_sub.sub_id) then
        raise exception using errcode = 'PQ024',
            message = format('this session does not own slot %L', p_sub.sub_consumer),
            hint = 'Claim the slot first (pgque.claim_slot); a session that lost its lock '
                   'must not receive or ack for the slot.';
    end if;
end
$$;

-- pgque.claim_slot(queue, consumer, slot): tries, without waiting, to take
-- the slot's session advisory lock; true when this session now holds it
-- (also when it already did; the lock is never taken twice).
create or replace function pgque.claim_slot(p_queue text, p_consumer text, p_slot integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key bigint := pgque.slot_lock_key(p_queue, p_consumer, p_slot);
begin
    return pgque._holds_slot((v_key & x'ffffffff'::bigint)::integer)
        or pg_try_advisory_lock(v_key);
end
$$;

-- pgque.release_slot(queue, consumer, slot): releases the slot's lock if
-- this session holds it; true when it did.
create or replace function pgque.release_slot(p_queue text, p_consumer text, p_slot integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key bigint := pgque.slot_lock_key(p_queue, p_consumer, p_slot);
    v_sub_id integer := (v_key & x'ffffffff'::bigint)::integer;
    v_released boolean := false;
begin
    -- Unlock only while held (a session may hold it more than once if it took
    -- the key itself): unlocking a lock not held makes the server warn.
    while pgque._holds_slot(v_sub_id) loop
        perform pg_advisory_unlock(v_key);
        v_released := true;
    end loop;
    return v_released;
end
$$;

-- pgque.receive_partitioned(queue, consumer, slot, slots, max_events): like
-- receive(), for slot slot of slots of a consumer group: opens the slot's
-- batch under the receive lock and returns only the events whose key routes
-- to the slot. Refuses (PQ024) unless this session owns the slot.
create or replace function pgque.receive_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer,
    p_max_events integer default null)
returns table (batch_id bigint, ev_id bigint, ev_time timestamptz, ev_retry integer,
               ev_type text, ev_data text, ev_extra1 text, ev_extra2 text,
               ev_extra3 text, ev_extra4 text)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    -- Check ownership before taking the row lock, so a non-owner never waits,
    -- and whether there is anything to receive, so an idle poll writes nothing.
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, false);
    perform pgque._require_owner(v.sub);
    if not pgque._has_next_tick((v.queue).queue_id, v.cur) then
        return;  -- idle: no lock taken, nothing written
    end if;
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    return query select * from pgque._receive(v.queue, v.sub, v.cur, p_max_events, p_slot,
                                              p_slots);
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
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._ack(v.sub, v.cur, p_batch_id);
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
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    perform pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_nack_ids, p_nack_reasons,
                        p_retry_after, p_slot, p_slots);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
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
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_ev_ids, array[p_reason],
                       p_retry_after, p_slot, p_slots);
end
$$;

-- pgque.join_group(queue, consumer): registers this session as a live
-- member of the group with a shared session advisory lock, so workers can
-- count each other (see group_status) and share slots fairly. Idempotent.
create or replace function pgque.join_group(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_group pgque.consumer_group := pgque._group(pgque._queue_row(p_queue), p_consumer, null);
    v_key bigint := (pgque._group_lock_class() << 32) | v_group.cg_id;
begin
    if pgque._holds_lock(pgque._group_lock_class(), v_group.cg_id, 'ShareLock') then
        return false;
    end if;
    perform pg_advisory_lock_shared(v_key);
    return true;
end
$$;

-- pgque.group_status(queue, consumer): one row per slot of the group: slot,
-- owner backend pid (null when unowned), whether this session is the owner,
-- the number of live members (sessions that joined the group), and this
-- session's rank among them by backend pid (0-based; null if not a member).
-- A member's fair share is members' integer share of the slots, plus one for
-- the first (slots % members) ranks, so the shares always add up to slots.
create or replace function pgque.group_status(p_queue text, p_consumer text)
returns table (slot integer, owner_pid integer, mine boolean, members integer,
               my_rank integer)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
begin
    return query
    with locks as materialized (
        select l.classid, l.objid, l.pid, l.mode from pg_locks l
         where l.locktype = 'advisory' and l.granted and l.objsubid = 1
           -- Advisory locks are per database, but pg_locks shows the whole
           -- cluster: without this, another database's slots would look owned.
           and l.database = (select oid from pg_database where datname = current_database())
           and l.classid in (pgque._slot_lock_class()::oid, pgque._group_lock_class()::oid)),
    members as (
        select array_agg(distinct m.pid order by m.pid) as pids from locks m
         where m.classid = pgque._group_lock_class()::oid and m.objid = v_group.cg_id::oid
           and m.mode = 'ShareLock')
    select k::integer,
           o.pid,
           coalesce(o.pid = pg_backend_pid(), false),
           coalesce(cardinality(members.pids), 0),
           array_position(members.pids, pg_backend_pid()) - 1
      from generate_series(0, v_group.cg_slots - 1) k
      cross join members
      left join pgque.subscription s
        on s.sub_queue = v_queue.queue_id
       and s.sub_consumer = pgque._slot_name(p_consumer, k, v_group.cg_slots)
      left join locks o
        on o.classid = pgque._slot_lock_class()::oid and o.objid = s.sub_id::oid
       and o.mode = 'ExclusiveLock'
     order by k;
end
$$;
