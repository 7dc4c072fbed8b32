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
-- may use the group. For a group that owns by lease (slots/lease.sql) the
-- caller's lease becomes a member (PQ035 for a call without one).
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
    -- The group's mode, read under a lock that set_ownership waits for.
    select * into v_group from pgque.consumer_group where cg_id = v_group.cg_id for key share;
    perform pgque._require_mode(v_queue, v_group);
    if v_group.cg_lease is not null then  -- by lease: the caller's lease is the member
        update pgque.lease set lease_member = true
         where lease_id = pgque._lease_id() and lease_group = v_group.cg_id
           and not lease_member;
        return found;
    end if;
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
-- so a worker claims it (and claim_slot renews the key). For a group that
-- owns by lease (slots/lease.sql) members and owners are live leases, and
-- my_pid is the caller's lease id.
create or replace function pgque.group_status(
    p_queue text, p_consumer text,
    out members integer, out my_rank integer, out my_pid bigint, out owner_pids bigint[])
language plpgsql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
begin
    if v_group.cg_lease is not null then
        select * into members, my_rank, my_pid, owner_pids
          from pgque._lease_group_status(v_queue, v_group);
    else
        select * into members, my_rank, my_pid, owner_pids
          from pgque._advisory_group_status(v_queue, v_group);
    end if;
end
$$;

-- pgque._advisory_group_status(queue, group): group_status for a group that
-- owns by advisory lock, from pg_locks.
create or replace function pgque._advisory_group_status(
    v_queue pgque.queue, v_group pgque.consumer_group,
    out members integer, out my_rank integer, out my_pid bigint, out owner_pids bigint[])
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    p_consumer text := v_group.cg_consumer;
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
