-- pgque: slot ownership by lease, for clients behind a transaction pooler.
--
-- A slot is owned by a session advisory lock (see ownership.sql): it means
-- something only while every call of the owner reaches one server session.
-- Behind PgBouncer in transaction mode consecutive transactions of a client
-- run on whichever server session is free, so a group may own its slots by
-- lease instead (pgque.set_ownership(queue, group, 'lease', lease_time)).
--
-- A lease is a row with an expiry (pgque.lease), taken by a client for a
-- group with take_lease, which returns a random token that only the client
-- knows. Every call of the client that acts as an owner carries the token:
-- the client wraps an argument of the call in pgque.leased(value, token),
-- which sets it for the call's transaction (a transaction never spans
-- two server sessions, even behind a pooler), so check and call are one
-- statement. A lease claims slots (claim_slot), each claim taking a new epoch
-- at once (slot_claim.sc_lease names the lease); receive, ack, nack and
-- release of the slot pass only while the claim still names the caller's
-- lease and the lease has not expired, by the database's clock at the moment
-- of the check. The holder renews its lease (renew_lease) well before it
-- expires; a lease that expired is dead for good: every call made with its
-- token fails with PQ034, and its slots may be claimed by anyone, each with a
-- new epoch, which fences the old holder's handlers out (check_fence). So a
-- crashed or frozen holder's slots move after at most the lease time, where
-- the advisory locks of a dead session go at once: advisory ownership stays
-- the default.
--
-- A group uses one mode at a time: a call with a lease on a group that owns
-- by advisory lock, or a claim or join without one on a group that owns by
-- lease, fails with PQ035, and set_ownership changes the mode only while
-- nobody owns a slot or is a member in the other mode.

-- pgque.leased(value, token): returns value, having set token as the lease
-- of the caller for the rest of the transaction (setting pgque.lease). Wrap an
-- argument of an owner's call in it. 22023 for a token that is not 32 to 64
-- characters.
create or replace function pgque.leased(p_value text, p_token text)
returns text
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if p_token is null or length(p_token) not between 32 and 64 then
        raise exception using errcode = '22023',
            message = 'a lease token must have 32 to 64 characters';
    end if;
    perform set_config('pgque.lease', p_token, true);
    return p_value;
end
$$;

-- pgque._lease_token(): the token leased() set for this transaction, or null.
create or replace function pgque._lease_token()
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select nullif(current_setting('pgque.lease', true), '') $$;

-- pgque._lease_id(): the id of the caller's lease (the token of leased()),
-- null when the call carries none; PQ034 when the lease expired or is unknown.
-- Expiry is judged by clock_timestamp(), not by the transaction's start.
create or replace function pgque._lease_id()
returns bigint
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_token text := pgque._lease_token();
    v_id bigint;
begin
    if v_token is null then
        return null;
    end if;
    select l.lease_id into v_id from pgque.lease l
     where l.lease_token = v_token and l.lease_until > clock_timestamp();
    if v_id is null then
        raise exception using errcode = 'PQ034',
            message = 'the lease of this client expired (or was never taken)',
            hint = 'Its slots may have passed to other owners: take a new lease '
                   '(pgque.take_lease) and claim slots again.';
    end if;
    return v_id;
end
$$;

-- pgque._lease_alive(lease_id, queue, group): whether that lease exists, has
-- not expired, and was taken by a login role that may still use the group
-- (a lease whose role lost the group owns nothing: its slots may be claimed).
create or replace function pgque._lease_alive(
    p_lease bigint, p_queue pgque.queue, p_group pgque.consumer_group)
returns boolean
language sql volatile
set search_path = pg_catalog, pg_temp
as $$
    select p_lease is not null and exists (
        select 1 from pgque.lease l
         where l.lease_id = p_lease and l.lease_until > clock_timestamp()
           and pgque._may_consume(l.lease_role, p_queue, p_group.cg_owner, p_group.cg_grantees))
$$;

-- pgque._require_mode(queue, group): PQ035 unless the call's way of owning
-- matches the group's: a lease (leased()) for a group that owns by lease,
-- none for a group that owns by advisory lock.
create or replace function pgque._require_mode(p_queue pgque.queue, p_group pgque.consumer_group)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if (p_group.cg_lease is null) <> (pgque._lease_token() is null) then
        raise exception using errcode = 'PQ035',
            message = format('consumer group %L of queue %L owns its slots by %s, and this call '
                             'comes %s', p_group.cg_consumer, p_queue.queue_name,
                             case when p_group.cg_lease is null then 'advisory lock'
                                  else 'lease' end,
                             case when p_group.cg_lease is null then 'with a lease'
                                  else 'without one' end),
            hint = 'A group uses one mode at a time: start its workers with the group''s '
                   'ownership, or change it (pgque.set_ownership) while no worker runs.';
    end if;
end
$$;

-- pgque.take_lease(queue, consumer, name, member): a new lease of the group for
-- the caller, which must use the group (PQ014) and own its slots by lease
-- (PQ035): its id, its token (keep it secret: it is the caller's identity)
-- and the group's lease time, after which it expires unless renewed. name
-- says who holds it (1 to 200 characters, 22023 otherwise); a member lease
-- counts in the group's fair share (group_status), as join_group's session
-- does.
create or replace function pgque.take_lease(
    p_queue text, p_consumer text, p_name text, p_member boolean default false,
    out lease_id bigint, out token text, out lease interval)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
begin
    if p_name is null or length(p_name) not between 1 and 200 then
        raise exception using errcode = '22023',
            message = 'a lease''s name must have 1 to 200 characters';
    end if;
    perform pgque._require_counting_session(v_queue, v_group);
    -- Serialized with set_ownership (which updates the row): no lease is taken
    -- on a group that is changing to advisory locks.
    select * into v_group from pgque.consumer_group where cg_id = v_group.cg_id for key share;
    if v_group.cg_lease is null then
        raise exception using errcode = 'PQ035',
            message = format('consumer group %L of queue %L owns its slots by advisory lock, '
                             'not by lease', p_consumer, v_queue.queue_name),
            hint = 'Change it with pgque.set_ownership(queue, group, ''lease'') while no '
                   'worker runs.';
    end if;
    token := encode(sha256(uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid())), 'hex');
    insert into pgque.lease (lease_token, lease_group, lease_role, lease_name, lease_member,
                             lease_until)
    values (token, v_group.cg_id, pgque._session_role(), p_name, coalesce(p_member, false),
            clock_timestamp() + v_group.cg_lease)
    returning pgque.lease.lease_id into lease_id;
    lease := v_group.cg_lease;
end
$$;

-- pgque.renew_leases(tokens): extends each live lease of tokens by its
-- group's lease time from now; returns the tokens it extended. A lease that
-- expired (or never was) is left out: it is not brought back, as its slots
-- may have moved. So is one whose group the caller's login role may no
-- longer use. One statement for all the leases of a worker.
create or replace function pgque.renew_leases(p_tokens text[])
returns text[]
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    with renewed as (
        update pgque.lease l set lease_until = clock_timestamp() + g.cg_lease
          from pgque.consumer_group g, pgque.queue q
         where l.lease_token = any(p_tokens) and l.lease_until > clock_timestamp()
           and g.cg_id = l.lease_group and g.cg_lease is not null and q.queue_id = g.cg_queue
           and pgque._may_consume(pgque._session_role(), q, g.cg_owner, g.cg_grantees)
        returning l.lease_token)
    select coalesce(array_agg(lease_token), '{}') from renewed
$$;

-- pgque.renew_lease(token): renew_leases for one lease: its group's lease
-- time; PQ034 when it was not renewed (expired, never was, or its group no
-- longer usable by the caller's login role).
create or replace function pgque.renew_lease(p_token text)
returns interval
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if cardinality(pgque.renew_leases(array[p_token])) = 0 then
        raise exception using errcode = 'PQ034',
            message = 'the lease of this client expired (or was never taken)',
            hint = 'Its slots may have passed to other owners: take a new lease '
                   '(pgque.take_lease) and claim slots again.';
    end if;
    return (select g.cg_lease from pgque.lease l
              join pgque.consumer_group g on g.cg_id = l.lease_group
             where l.lease_token = p_token);
end
$$;

-- pgque.end_lease(token): ends the lease: its slots are released (their
-- epochs end: check_fence refuses them from now on) and the lease is gone.
-- Returns how many slots it owned; 0 for a token that names no lease. PQ014
-- unless the caller's login role may use the lease's group: a token alone
-- is no key (a trigger of another team's could read it in the holder's
-- transaction).
create or replace function pgque.end_lease(p_token text)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_lease pgque.lease;
    v_group pgque.consumer_group;
    v_id bigint;
    v_count integer;
begin
    select * into v_lease from pgque.lease where lease_token = p_token;
    if not found then
        return 0;
    end if;
    select * into v_group from pgque.consumer_group where cg_id = v_lease.lease_group;
    perform pgque._require_counting_session(pgque._queue_of(v_group), v_group);
    delete from pgque.lease where lease_id = v_lease.lease_id returning lease_id into v_id;
    if v_id is null then
        return 0;
    end if;
    update pgque.slot_claim set sc_lease = null, sc_time = now() where sc_lease = v_id;
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- pgque._claim_by_lease(sub, queue, group): claim_slot for a group that owns by
-- lease, for the caller's lease (PQ034 when it expired or is another
-- group's): true when the slot's claim names the lease now (a new epoch when
-- it did not before), false when another live lease holds it or a
-- transaction that checked the slot's epoch still runs (see fence.sql; no
-- wait).
create or replace function pgque._claim_by_lease(
    p_sub pgque.subscription, p_queue pgque.queue, p_group pgque.consumer_group)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_claim pgque.slot_claim;
    p_lease bigint := pgque._lease_id();
begin
    if not exists (select 1 from pgque.lease l
                    where l.lease_id = p_lease and l.lease_group = p_group.cg_id) then
        raise exception using errcode = 'PQ034',
            message = format('the lease of this client is not one of group %L',
                             p_group.cg_consumer),
            hint = 'Take a lease of the group (pgque.take_lease) to claim its slots.';
    end if;
    select * into v_claim from pgque.slot_claim where sc_sub = p_sub.sub_id
       for no key update skip locked;
    if not found then
        if exists (select 1 from pgque.slot_claim where sc_sub = p_sub.sub_id) then
            return false;  -- held by a checking transaction
        end if;
        insert into pgque.slot_claim (sc_sub, sc_epoch, sc_pid, sc_lease)
        values (p_sub.sub_id, pgque._new_epoch(), null, p_lease)
        on conflict (sc_sub) do nothing;
        return found;
    end if;
    if v_claim.sc_lease = p_lease then
        return true;
    end if;
    if pgque._lease_alive(v_claim.sc_lease, p_queue, p_group) then
        return false;
    end if;
    update pgque.slot_claim
       set sc_epoch = pgque._new_epoch(), sc_pid = null, sc_lease = p_lease,
           sc_time = now()
     where sc_sub = p_sub.sub_id;
    return true;
end
$$;

-- pgque.set_ownership(queue, consumer, mode, lease): how the group's slots
-- are owned: 'advisory' (session advisory locks, the default of a new group)
-- or 'lease' (leases of lease each, 1 second to 1 hour; 15 seconds unless
-- given). The same mode again only sets the lease time (for leases renewed
-- from then on). Another mode is refused (PQ035) while a slot is owned or a
-- member has joined in the current one. For roles that may use the group
-- (PQ014); 22023 for another mode or a lease time out of range. Returns
-- whether the mode changed.
create or replace function pgque.set_ownership(
    p_queue text, p_consumer text, p_mode text, p_lease interval default interval '15 seconds')
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
    v_lease interval;
    v_status record;
begin
    if p_mode is null or p_mode not in ('advisory', 'lease') then
        raise exception using errcode = '22023',
            message = format('ownership must be ''advisory'' or ''lease'', not %L', p_mode);
    end if;
    if p_mode = 'lease' then
        if p_lease is null or p_lease not between interval '1 second' and interval '1 hour' then
            raise exception using errcode = '22023',
                message = format('a lease time must be 1 second to 1 hour, not %s',
                                 coalesce(p_lease::text, 'null'));
        end if;
        v_lease := p_lease;
    end if;
    -- The row lock serializes with take_lease and with claims and joins by
    -- advisory lock (both share-lock the row): what is counted below stays.
    select * into v_group from pgque.consumer_group where cg_id = v_group.cg_id for update;
    if (v_group.cg_lease is null) = (p_mode = 'advisory') then
        if p_mode = 'lease' and v_group.cg_lease <> v_lease then
            update pgque.consumer_group set cg_lease = v_lease where cg_id = v_group.cg_id;
        end if;
        return false;
    end if;
    if v_group.cg_lease is null then
        v_status := pgque._advisory_group_status(v_queue, v_group);
    else
        v_status := pgque._lease_group_status(v_queue, v_group);
    end if;
    if v_status.members > 0 or exists (select 1 from unnest(v_status.owner_pids) o
                                        where o is not null) then
        raise exception using errcode = 'PQ035',
            message = format('consumer group %L of queue %L is in use by %s (%s members): '
                             'its ownership cannot change now', p_consumer,
                             v_queue.queue_name,
                             case when v_group.cg_lease is null then 'advisory locks'
                                  else 'leases' end, v_status.members),
            hint = 'Stop the group''s workers first.';
    end if;
    update pgque.consumer_group set cg_lease = v_lease where cg_id = v_group.cg_id;
    -- By lease the slots have no lock key (a lock taken by hand on a key read
    -- before owns nothing: _holds_slot); by lock, fresh ones.
    update pgque.subscription
       set sub_lock_key = case when v_lease is null then pgque._random_key() end
     where sub_id in (select s.sub_id from pgque._group_subs(v_group) s);
    -- The old mode's claims name nobody now; the next owner takes a new epoch.
    update pgque.slot_claim set sc_pid = null, sc_lease = null, sc_time = now()
     where sc_sub in (select s.sub_id from pgque._group_subs(v_group) s)
       and (sc_pid is not null or sc_lease is not null);
    delete from pgque.lease where lease_group = v_group.cg_id;
    return true;
end
$$;

-- pgque._lease_group_status(queue, group): group_status for a group that
-- owns by lease: the live member leases of roles that may use the group, the
-- rank of the caller's lease among them by id, its id (as my_pid), and the
-- lease owning each slot (owner_pids), null where none is live.
create or replace function pgque._lease_group_status(
    p_queue pgque.queue, p_group pgque.consumer_group,
    out members integer, out my_rank integer, out my_pid bigint, out owner_pids bigint[])
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_me bigint;
begin
    if pgque._lease_token() is not null then
        v_me := pgque._lease_id();
    end if;
    with live as materialized (
        select l.lease_id, l.lease_member from pgque.lease l
         where l.lease_group = p_group.cg_id and l.lease_until > clock_timestamp()
           and pgque._may_consume(l.lease_role, p_queue, p_group.cg_owner, p_group.cg_grantees)),
    member_ids as (
        select array_agg(live.lease_id order by live.lease_id) as ids from live
         where live.lease_member)
    select coalesce(cardinality(m.ids), 0),
           array_position(m.ids, v_me) - 1,
           v_me,
           (select array_agg(live.lease_id order by n)
              from generate_series(0, p_group.cg_slots - 1) n
              left join pgque._group_subs(p_group) s on s.slot = n
              left join pgque.slot_claim c on c.sc_sub = s.sub_id
              left join live on live.lease_id = c.sc_lease)
      into members, my_rank, my_pid, owner_pids
      from member_ids m;
end
$$;

-- pgque._queue_of(group): the group's queue row.
create or replace function pgque._queue_of(p_group pgque.consumer_group)
returns pgque.queue
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select q from pgque.queue q where q.queue_id = p_group.cg_queue $$;

-- pgque._purge_leases(): deletes the leases expired for more than a minute
-- (maintenance): a claim naming one names nobody, and a call with its token
-- fails as with any expired lease (PQ034). Returns how many it deleted.
create or replace function pgque._purge_leases()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count integer;
begin
    delete from pgque.lease where lease_until < clock_timestamp() - interval '1 minute';
    get diagnostics v_count = row_count;
    return v_count;
end
$$;
